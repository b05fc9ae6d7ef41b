"""A single-turn verifiers environment for tidal's tests (verifiers' API only): ``i+i=``, two reward
functions with weights 1.0 (``exact``: the reply is ``2i``) and 0.5 (``short``: at most 4 characters).
``mode`` breaks it on purpose: ``raise`` (the rubric raises on every task whose index is odd) or
``hang`` (the rubric never returns for odd indexes)."""

import asyncio

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str


class AddTaskConfig(vf.TaskConfig):
    mode: str = "ok"


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        if self.data.idx % 2 and self.config.mode == "raise":
            raise ValueError(f"rubric failure on task {self.data.idx}")
        if self.data.idx % 2 and self.config.mode == "hang":
            await asyncio.sleep(3600)
        return float((trace.last_reply or "").strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") <= 4)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 10
    task: AddTaskConfig = AddTaskConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        return [AddTask(AddData(idx=i, prompt=f"{i}+{i}=", answer=str(2 * i)), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["AddTaskset"]
