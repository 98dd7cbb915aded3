"""The typed seams: backends implement the protocols they declare, and worker groups call them through the
protocol's methods (never a method-name string)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from rlflow.engines.cluster.groups import LocalWorkerGroup, check_implements
from rlflow.engines.core.protocols import RolloutBackend, TrainBackend, method_name, missing_methods
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend

BACKENDS = [TorchTrainBackend, TorchRolloutBackend, SGLangRolloutBackend]


def declared(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if getattr(b, "_is_protocol", False) and b.__name__ != "Protocol"]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_backends_implement_what_they_declare(cls: type) -> None:
    assert declared(cls), f"{cls.__name__} declares no protocol"
    for protocol in declared(cls):
        assert missing_methods(cls, protocol) == [], protocol.__name__


def test_megatron_backend_implements_what_it_declares() -> None:
    pytest.importorskip("megatron.core")
    from rlflow.engines.train.megatron.backend import MegatronTrainBackend

    assert TrainBackend in declared(MegatronTrainBackend)
    for protocol in declared(MegatronTrainBackend):
        assert missing_methods(MegatronTrainBackend, protocol) == [], protocol.__name__
    assert not code_bases(MegatronTrainBackend)


def code_bases(cls: type) -> list[str]:
    """The classes `cls` inherits that are not protocols (they would bring it code)."""
    return [b.__name__ for b in cls.__mro__[1:]
            if b not in (object, typing.Generic) and not getattr(b, "_is_protocol", False)]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_backends_inherit_declarations_only(cls: type) -> None:
    """A backend's bases say what it may be called through; what a transport does on its side comes by
    composition from engines/sync/ (docs/architecture.md, "Weight sync"), never from an inherited mixin."""
    assert code_bases(cls) == []


class HalfTrainer(TrainBackend):
    """Declares TrainBackend but implements only one of its methods."""

    def __init__(self, value: int = 3):
        self.value = value

    def pid(self) -> int:
        return self.value


def test_a_missing_method_fails_when_the_group_starts() -> None:
    assert "train_step" in missing_methods(HalfTrainer, TrainBackend)
    assert "pid" not in missing_methods(HalfTrainer, TrainBackend)
    with pytest.raises(TypeError, match=r"HalfTrainer does not implement TrainBackend: missing \[.*'train_step'"):
        LocalWorkerGroup([HalfTrainer()], protocols=[TrainBackend])
    with pytest.raises(TypeError, match="does not implement RolloutBackend"):
        check_implements(TorchTrainBackend, [RolloutBackend])


def test_groups_call_the_workers_own_method_through_the_protocol() -> None:
    group = LocalWorkerGroup([HalfTrainer(1), HalfTrainer(2)])
    assert group.call(TrainBackend.pid) == [1, 2]  # the workers' pid, not the protocol's empty body
    assert group.call_one(1, TrainBackend.pid) == 2
    assert group.wait(group.submit(TrainBackend.pid)) == [1, 2]


def test_a_method_name_string_is_refused() -> None:
    with pytest.raises(TypeError, match=r"calls a backend's method \(e.g. TrainBackend.save\), got 'pid'"):
        LocalWorkerGroup([HalfTrainer()]).call("pid")
    assert method_name(TrainBackend.save) == "save"


def test_no_worker_call_in_the_code_names_a_method_by_string() -> None:
    """Every group.call / call_each / call_one / submit* (also through functools.partial) in the installed packages
    and bench/ passes a method, not its name."""
    verbs = {"call", "call_each", "call_rank0", "call_one", "submit", "submit_each", "submit_rank0"}
    repo = Path(__file__).resolve().parents[1]
    found = []
    for path in [p for d in ("engines", "tasks", "flows", "examples", "bench") for p in (repo / d).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn, args = node.func, node.args
            if isinstance(fn, ast.Attribute) and fn.attr in verbs:
                handle = args[1:2] if fn.attr == "call_one" else args[:1]
            elif (isinstance(fn, ast.Name) and fn.id == "partial" and args and isinstance(args[0], ast.Attribute)
                  and args[0].attr in verbs):
                handle = args[2:3] if args[0].attr == "call_one" else args[1:2]
            else:
                continue
            found += [f"{path.relative_to(repo)}:{node.lineno}" for a in handle
                      if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    assert found == []
