"""``m2nkit demo --trainer bridge:...``: the spec grammar and the CLI's one-line refusals.

Cheap (no torch, no megatron): what a user can get wrong is refused before
any process starts. The demo itself runs in tests/integration/test_bridge_demo.py.
"""

from __future__ import annotations

import pytest

from m2nkit.engine.tools.cli import main
from m2nkit.engine.tools.demo_bridge import parse_bridge_spec


@pytest.mark.parametrize("text,ranks,canonical", [
    ("bridge:tp=2,pp=2", 4, "bridge:tp=2,pp=2"),
    ("bridge:tp=2,ep=2", 4, "bridge:tp=2,pp=1,ep=2,dp=2"),   # dp: least the expert grid fits
    ("bridge:pp=2,tp=2,ep=2", 8, "bridge:tp=2,pp=2,ep=2,dp=2"),
    ("bridge:tp=2,ep=2,etp=1", 2, "bridge:tp=2,pp=1,ep=2,etp=1"),
])
def test_bridge_spec_sizes_as_megatron_core_takes_them(text, ranks, canonical):
    spec = parse_bridge_spec(text)
    assert spec.num_ranks == ranks
    assert str(spec) == canonical


@pytest.mark.parametrize("text,says", [
    ("bridge:tp=2,vpp=2", "'bridge' size 'vpp' is not supported; sizes are tp, pp, ep, etp, dp"),
    ("bridge:tp=x", "'bridge' tp='x' is not a positive integer"),
    ("bridge:", "is not bridge:tp=T,pp=P[,ep=E][,etp=X][,dp=D]"),
    ("bridge:tp=2,ep=3,dp=1", "not divisible by etp*ep = 2*3"),
    ("megatron:tp=2", "is not bridge:tp=T,pp=P"),
])
def test_bad_bridge_specs_are_refused_naming_the_value(text, says):
    with pytest.raises(ValueError) as e:
        parse_bridge_spec(text)
    assert says in str(e.value) and f"'{text}'" in str(e.value)


@pytest.mark.parametrize("argv,says", [
    (["demo", "--trainer", "bridge:tp=2,vpp=2"], "'bridge' size 'vpp' is not supported"),
    (["demo", "--trainer", "fsdp:2", "--bridge-mode", "export"],
     "--bridge-mode needs a bridge: trainer"),
    (["demo", "--trainer", "bridge:tp=2,pp=2", "--receiver", "vllm"],
     "runs with --receiver stand-in only"),
    (["demo", "--colocated", "--receiver", "vllm"], "--colocated runs with --receiver stand-in"),
])
def test_cli_refuses_in_one_line_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


class _Reached(Exception):
    """Raised where the demo would start its processes: every check before it passed."""


@pytest.fixture
def stop_at_process_start(monkeypatch):
    import m2nkit.engine.tools.server as server

    def reached(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(server, "InferenceServer", reached)


def test_export_mode_carries_gpt_oss_so_it_is_not_refused(tmp_path, stop_at_process_start):
    """bridge_source(mode="export") carries GPT-OSS (Bridge's export, full tensors): the
    demo must get as far as starting its processes, not refuse for want of m2nkit's
    Megatron-Core names (those are what the shard-level modes need)."""
    from m2nkit.engine.tools.demo_bridge import run_bridge_demo

    with pytest.raises(_Reached):
        run_bridge_demo("tiny-gpt-oss", "bridge:tp=2,ep=2,etp=1", "vllm:tp=2", mode="export",
                        rounds=1, workdir=str(tmp_path), log=lambda m: None)


def test_a_refusal_names_the_spec_the_user_typed(tmp_path, stop_at_process_start):
    from m2nkit.engine.tools.demo_bridge import run_bridge_demo

    with pytest.raises(ValueError) as e:
        run_bridge_demo("tiny-gpt-oss", "bridge:tp=2,ep=2,etp=1", "vllm:tp=2", mode="tasks",
                        rounds=1, workdir=str(tmp_path), log=lambda m: None)
    msg = str(e.value)
    assert msg.startswith("trainer spec 'bridge:tp=2,ep=2,etp=1': GptOssForCausalLM has no "
                          "Megatron-Core names"), msg
    assert "'megatron:" not in msg, msg
