"""verifiers' own chat program, run in this process instead of as a ``uv`` subprocess per rollout.

verifiers 0.4 (``verifiers.v1``) runs every rollout as a program: its ``null`` harness writes its
chat loop (``harnesses/utils/core.py`` with its MCP and compaction helpers, bundled as one PEP 723
script) into the rollout's runtime, ``uv sync``s it, and starts it as a subprocess that talks to the
interception server. That costs ~1.4 s of CPU per episode here (16 concurrent episodes of a one-turn
task: 22.5 s on 2 cores), so a training step of 512 episodes would spend ~12 minutes starting
Python. This harness runs **the same program text** (``CHAT_PROGRAM_SOURCE``: verifiers' bytes, not
a rewrite) in-process: the source is executed once into a namespace, and each rollout calls its
``main()`` with the arguments the ``null`` harness would have passed on its command line. Everything
around it stays verifiers': the interception server (trace building, stop conditions, tool gate),
MCP tool servers, the runtime, the rubric.

Select it as a harness plugin: ``agent.harness.id = "tidal_vf_inprocess"`` (tidal does that for
``env.name=verifiers`` unless ``env.verifiers.harness`` names another). verifiers imports a harness by a
top-level module name (a dotted id is looked up under ``verifiers.v1.harnesses``), so importing this
module also registers it in ``sys.modules`` under that name. What differs from ``null``: a
program that exits through ``SystemExit`` (verifiers' model-transport exit code 97) is reported with
that code, as the subprocess would; anything else it raises is exit code 1 with the traceback as
stderr. It cannot run code (no ``--bash``), like ``null``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import traceback
import types

from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

from tidal.envs.verifiers_config import INPROCESS_HARNESS

_PROGRAM: dict | None = None


def program() -> dict:
    """The chat program's namespace: ``CHAT_PROGRAM_SOURCE`` executed once, under a name other than
    ``__main__`` so its entry point does not run."""
    global _PROGRAM
    if _PROGRAM is None:
        namespace = {"__name__": "tidal_vf_chat_program"}
        exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)  # noqa: S102
        _PROGRAM = namespace
    return _PROGRAM


def program_args(ctx: ModelContext, endpoint: str, secret: str, mcp_urls: dict[str, str], tool_timeout: float,
                 system_prompt: str | None, prompt, tool_interception_url: str | None) -> argparse.Namespace:
    """The namespace ``parse_args`` would return for the command line ``launch_chat_program`` builds."""
    initial_file = ""
    if prompt is not None and not isinstance(prompt, str):  # a Messages prompt: the program reads and deletes a file
        fd, initial_file = tempfile.mkstemp(prefix="tidal-vf-initial-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([message_to_wire(m) for m in prompt], f)
    mcp = {"mcpServers": {name: {"url": url, "timeout": tool_timeout} for name, url in mcp_urls.items()}}
    return argparse.Namespace(
        base_url=endpoint, api_key=secret, model=ctx.model, system_prompt=system_prompt or "",
        prompt=prompt if isinstance(prompt, str) else "", initial_messages_file=initial_file,
        mcp_config=json.dumps(mcp) if mcp_urls else "", tool_interception_url=tool_interception_url or "",
        bash=False, compaction=False, summarize_at_tokens=None, edit=False, search=False, serper_key="")


async def run_program(args: argparse.Namespace) -> ProgramResult:
    """One run of the chat program's ``main()`` with ``args`` (its own copy of the globals, so concurrent
    rollouts never see each other's arguments)."""
    namespace = program()
    main = types.FunctionType(namespace["main"].__code__, {**namespace, "parse_args": lambda: args}, "main")
    try:
        await main()
    except SystemExit as e:  # the program's own exit (97: the model connection failed)
        code = e.code if isinstance(e.code, int) else 1
        return ProgramResult(code, "", traceback.format_exc())
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001  (the program crashed: what its subprocess would have exited with)
        return ProgramResult(1, "", traceback.format_exc())
    finally:
        if args.initial_messages_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.initial_messages_file)
    return ProgramResult(0, "", "")


class InProcessChatConfig(HarnessConfig):
    pass


class InProcessChatHarness(Harness[InProcessChatConfig]):
    """verifiers' ``null`` harness without the subprocess (module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData,
                     tool_interception_url: str | None = None) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        return await run_program(program_args(ctx, endpoint, secret, mcp_urls, self.config.tool_timeout,
                                              system_prompt, prompt, tool_interception_url))


__all__ = ["InProcessChatHarness"]
sys.modules.setdefault(INPROCESS_HARNESS, sys.modules[__name__])
