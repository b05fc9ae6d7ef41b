"""A tool-use environment written with PrimeIntellect's verifiers API only (``verifiers.v1``, no tidal imports).

Each task is a product of two 2-digit numbers (``37*54=``). The model has one tool, ``calculator``,
served by the taskset's ``vf.Toolset`` over MCP (one server for the run, started by verifiers as
``python -m verifiers_calculator``), as any verifiers tool is. The rubric has two reward
functions: ``correct`` (weight 1.0: the last reply is the product) and ``used_tool`` (weight 0.0: a
zero-weight signal, logged but not trained on: whether the model called the calculator).

verifiers runs it as it runs any taskset: ``eval examples/verifiers_calculator.py`` (verifiers' own
CLI). tidal trains it unchanged: ``tidal train verifiers_quickstart`` (or ``env.name=verifiers
env.verifiers.id=examples/verifiers_calculator.py``).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf

SYSTEM = "use the calculator, then reply with the number only."


class ProductData(vf.TaskData):
    answer: str
    """The product, as digits."""


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # advertise the tool bare, as ``calculator`` (one server: no name can collide)

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Multiply two integers written as A*B."""
        left, sep, right = expression.partition("*")
        if not sep or not left.strip().isdigit() or not right.strip().isdigit():
            return "error"
        return str(int(left) * int(right))


class ProductTask(vf.Task[ProductData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)

    @vf.reward(weight=0.0)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.tool_calls for m in trace.assistant_messages))


class ProductConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    seed: int = 0
    min_operand: int = 10
    """Smallest operand (the largest is 99). 32 makes every product 4 digits (32*32 = 1024)."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    @classmethod
    def toolsets(cls, config: ProductConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    def load(self) -> list[ProductTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(self.config.min_operand, 99), rng.randint(self.config.min_operand, 99)
            data = ProductData(idx=i, prompt=f"{a}*{b}=", system_prompt=SYSTEM, answer=str(a * b))
            tasks.append(ProductTask(data, self.config.task))
        return tasks


__all__ = ["ProductTaskset"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m verifiers_calculator`
    CalculatorToolset.run()
