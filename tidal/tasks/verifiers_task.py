"""A verifiers environment's tasks as tidal's task (``env.name=verifiers``, docs/environments.md).

verifiers 0.4 (``verifiers.v1``) loads an environment as a *taskset*: ``load()`` yields ``vf.Task``
objects, each holding its immutable ``TaskData`` (the prompt, the system prompt, whatever its rubric
grades against). tidal trains on those tasks unchanged: ``load_tasksets`` builds the taskset exactly
as verifiers' own ``eval`` does (``vf.resolve_env_config`` + ``vf.load_environment``), once for
training and, when ``env.verifiers.eval_kwargs`` is set, once more for the held-out split; otherwise
the last ``num_eval`` tasks are held out. Each task becomes a ``Prompt`` whose ``meta`` says where the
``vf.Task`` object is (``vf_split``, ``vf_index``): the episode runner (``serve/verifiers_bridge.py``)
hands that very object to the environment's rollout, so the prompt text here is only for display
(the inspector, logs); the model sees what the environment's own program sends.

A missing ``verifiers`` package is one line naming the extra: ``pip install 'tidal[verifiers]'``. An
environment (or ``env.verifiers.demos``) whose module fails on import is one line naming its file and the
cause (``import_module_of``): a syntax error, a missing ``__all__``, an exception, even ``sys.exit``.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.envs.verifiers_config import VerifiersConfig
from tidal.tasks.config import TaskConfig
from tidal.tasks.rows import RowTask
from tidal.types import Prompt

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""tidal's source checkout: a relative ``env.verifiers.id`` (``examples/...``) is also looked up here."""
MISSING = "env.name=verifiers needs the verifiers extra: pip install 'tidal[verifiers]'"


def require_verifiers():
    """``verifiers.v1``, or a ConfigError that says which extra to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"{MISSING} ({e})") from None
    return vf


def module_id(spec: str, roots: tuple[Path, ...] = (SOURCE_ROOT,)) -> str:
    """The importable module name for ``env.verifiers.id``: an installed module's name as is; for a path
    (a ``.py`` file or a package folder) its parent goes on ``sys.path`` and its stem is the name."""
    if not (spec.endswith(".py") or "/" in spec):
        return spec
    path = Path(spec)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, *(Path(r) / path for r in roots)]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        raise ConfigError(f"env.verifiers.id={spec!r}: no such file or folder (looked in "
                          f"{', '.join(str(p.parent) for p in candidates)})")
    parent = str(found.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    # verifiers starts a taskset's tool servers as `python -m <module>`: they must find it too
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if parent not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([parent, *filter(None, paths)])
    return found.stem if found.suffix == ".py" else found.name


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def where(name: str) -> str:
    """``module 'name' (its file)``: what a message about a module names, so the file to fix is in it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that cannot be imported either
        spec = None
    origin = getattr(spec, "origin", None)
    return f"module {name!r}" + (f" ({origin})" if origin else "")


def import_module_of(key: str, spec: str, name: str, importer=importlib.import_module):
    """Import module ``name`` (``key={spec}``'s code) with ``importer``: a module that fails on import (a syntax
    error, an exception, a missing dependency, ``sys.exit``) is one ConfigError naming the key, the module, its
    file and the cause. A user module's import runs its top-level code in tidal's process: a ``sys.exit(3)``
    there used to end the run with exit code 3 and no message, anything else with a traceback."""
    try:
        return importer(name)
    except SystemExit as e:
        raise ConfigError(f"{key}={spec!r}: {where(name)} called sys.exit({e.code!r}) on import") from None
    except Exception as e:  # noqa: BLE001  (the user's code: whatever it raised, said in one line)
        raise ConfigError(f"{key}={spec!r}: cannot import {where(name)}: {type(e).__name__}: {first_line(e)}") \
            from None


def check_taskset(spec: str, name: str) -> None:
    """The taskset module ``name`` (``env.verifiers.id={spec}``) imports, as verifiers imports it, and exports
    one ``Taskset`` subclass through ``__all__``; else one ConfigError naming its file and the cause (verifiers
    itself would raise the missing ``__all__`` from inside its config validation, as a traceback)."""
    from verifiers.v1.utils.loaders import import_taskset, taskset_class

    import_module_of("env.verifiers.id", spec, name, import_taskset)
    try:
        taskset_class(name)
    except (AttributeError, TypeError, ValueError) as e:  # no `__all__`, no Taskset subclass in it, or two
        raise ConfigError(f"env.verifiers.id={spec!r}: {where(name)}: {first_line(e)}") from None


def env_config(vcfg: VerifiersConfig, kwargs: dict[str, Any], roots: tuple[Path, ...] = (SOURCE_ROOT,)):
    """The verifiers ``EnvConfig`` for the taskset with ``kwargs``: what ``eval <id> --env.taskset.*``
    builds, with the agent's harness and runtime from ``env.verifiers``."""
    vf = require_verifiers()
    from tidal.envs import vf_inprocess  # noqa: F401  (registers the in-process harness's module name)

    if not vcfg.id:
        raise ConfigError("env.name=verifiers needs env.verifiers.id: an installed taskset module or a path to one")
    taskset_id = module_id(vcfg.id, roots)
    check_taskset(vcfg.id, taskset_id)
    try:
        config_cls = vf.env_config_type(taskset_id)
        # every agent seat (``agent`` for a plain taskset, ``player`` for verifiers' OpenEnv env, ...)
        seats = [name for name, f in config_cls.model_fields.items()
                 if isinstance(f.annotation, type) and issubclass(f.annotation, vf.AgentConfig)]
        agent = {"harness": {"id": vcfg.harness}, "runtime": {"type": vcfg.runtime}}
        return vf.resolve_env_config({"taskset": {**kwargs, "id": taskset_id}, **{seat: agent for seat in seats}})
    except (ValueError, TypeError, ImportError) as e:  # pydantic's ValidationError is a ValueError
        first = str(e).strip().splitlines()
        raise ConfigError(f"env.verifiers (id={vcfg.id!r}, kwargs={kwargs}): {' '.join(first[:3])}") from None


def load_env(vcfg: VerifiersConfig, kwargs: dict[str, Any], roots: tuple[Path, ...] = (SOURCE_ROOT,)):
    """The verifiers environment (``vf.Env``) for ``kwargs``, built as verifiers' eval builds it."""
    vf = require_verifiers()
    cfg = env_config(vcfg, kwargs, roots)
    try:
        return vf.load_environment(cfg)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError(f"env.verifiers.id={vcfg.id!r}: verifiers could not load it: {type(e).__name__}: {e}") \
            from None


@dataclass
class VerifiersTasks:
    """The loaded environments and their tasks: ``train`` and ``eval`` lists of ``vf.Task``."""

    env: Any
    train: list
    eval: list
    eval_env: Any


def load_tasksets(vcfg: VerifiersConfig, roots: tuple[Path, ...] = (SOURCE_ROOT,)) -> VerifiersTasks:
    """Build the environment (and the held-out one) and read their tasks (see module docstring)."""
    env = load_env(vcfg, dict(vcfg.kwargs), roots)
    tasks = list(itertools.islice(iter(env.taskset), vcfg.max_tasks))
    if vcfg.eval_kwargs is None:
        if len(tasks) <= vcfg.num_eval:
            raise ConfigError(f"env.verifiers: the taskset has {len(tasks)} tasks; holding out env.verifiers.num_eval="
                              f"{vcfg.num_eval} leaves none to train on (lower it, or set env.verifiers.eval_kwargs)")
        cut = len(tasks) - vcfg.num_eval
        return VerifiersTasks(env, tasks[:cut], tasks[cut:], env)
    eval_env = load_env(vcfg, {**vcfg.kwargs, **vcfg.eval_kwargs}, roots)
    evals = list(itertools.islice(iter(eval_env.taskset), vcfg.num_eval))
    if not tasks or not evals:
        raise ConfigError(f"env.verifiers: {len(tasks)} training and {len(evals)} held-out tasks; both must be > 0")
    return VerifiersTasks(env, tasks, evals, eval_env)


def prompt_of(task, split: str, index: int) -> Prompt:
    """The tidal Prompt standing for ``task`` (its text is for display; see module docstring)."""
    data = task.data
    text = data.prompt if isinstance(data.prompt, str) else str(data.prompt or "")
    answer = getattr(data, "answer", "")
    return Prompt(uid=f"{split}-{index}", text=text, answer="" if answer is None else str(answer),
                  meta={"vf_split": split, "vf_index": index})


_LOADED: dict[tuple, VerifiersTasks] = {}


def loaded(vcfg: VerifiersConfig, roots: tuple[Path, ...] = (SOURCE_ROOT,)) -> VerifiersTasks:
    """``load_tasksets`` once per process and config: the task (this module) and the episode runner
    (``serve/verifiers_bridge.py``) must index the same task objects."""
    key = (vcfg.id, repr(sorted(vcfg.kwargs.items())), repr(vcfg.eval_kwargs), vcfg.num_eval, vcfg.max_tasks,
           vcfg.harness, vcfg.runtime)
    if key not in _LOADED:
        _LOADED[key] = load_tasksets(vcfg, roots)
    return _LOADED[key]


class VerifiersTask(RowTask):
    """tidal's Task over a verifiers environment's tasks (see module docstring)."""

    name = "verifiers"

    def __init__(self, cfg: TaskConfig, vcfg: VerifiersConfig, roots: tuple[Path, ...] = (SOURCE_ROOT,)):
        self.vcfg = vcfg
        self.tasks = loaded(vcfg, roots)
        train = [prompt_of(t, "train", i) for i, t in enumerate(self.tasks.train)]
        evals = [prompt_of(t, "eval", i) for i, t in enumerate(self.tasks.eval)]
        super().__init__(cfg, train, evals)

    def sft_example(self, prompt: Prompt) -> list[dict]:
        """A demonstration in the environment's own prompts: its system prompt and prompt, then what
        ``env.verifiers.demos`` says a correct episode's assistant (and tools) write."""
        if self.vcfg.demos is None:
            raise ConfigError("env.name=verifiers: a verifiers environment has no reference responses to warm-start "
                              "the tiny model on; set model.path to a model, or env.verifiers.demos to a function "
                              "that writes a correct episode (tidal train verifiers_quickstart does)")
        data = self.task_data(prompt)
        head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        user = data.prompt if isinstance(data.prompt, list) else [{"role": "user", "content": data.prompt}]
        return [*head, *user, *self._demos()(data)]

    def task_data(self, prompt: Prompt):
        split, index = prompt.meta["vf_split"], prompt.meta["vf_index"]
        return (self.tasks.train if split == "train" else self.tasks.eval)[index].data

    def _demos(self):
        if getattr(self, "_demo_fn", None) is None:
            self._demo_fn = demo_function(self.vcfg.demos)
        return self._demo_fn


def demo_function(spec: str, roots: tuple[Path, ...] = (SOURCE_ROOT,)):
    """The function ``env.verifiers.demos`` names (``module:function`` or ``path/file.py:function``)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"env.verifiers.demos={spec!r} must be 'package.module:function' or 'path/file.py:function'")
    module_name = module_id(target, roots) if target.endswith(".py") else target
    module = import_module_of("env.verifiers.demos", spec, module_name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"env.verifiers.demos={spec!r}: {target} has no function {name!r}")
    return fn
