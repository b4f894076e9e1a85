"""`kvmesh generate` bad input: exit status 2 and one stderr line that names the flag."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.cli import main

BAD: list[tuple[list[str], str]] = [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--prompt", ""], "--prompt"),
    (["--kv-eviction", "h2o"], "--kv-budget"),
    (["--kv-eviction", "h2o", "--kv-budget", "64", "--h2o-decay", "1.5"], "--h2o-decay"),
    (["--kv-eviction", "h2o", "--kv-budget", "64", "--h2o-decay", "0"], "--h2o-decay"),
    (["--kv-eviction", "streaming", "--kv-budget", "64", "--attention-sinks", "-1"], "--attention-sinks"),
    (["--kv-cache-memory-gib", "0"], "--kv-cache-memory-gib"),
    (["--room-wait-steps", "-1"], "--room-wait-steps"),
    (["--model", "no-such-model"], "--model"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_generate_bad_input_names_the_flag(extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "smollm2"] + ([] if "--prompt-file" in extra else ["--prompt", "hi"])
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh generate: {flag}") and "\n" not in err, err


def test_generate_unreadable_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmesh generate: --model") and "\n" not in err, err


def test_worker_peer_flags_and_their_env_fallbacks() -> None:
    """--peer-transfer / --transfer-port and KVMESH_PEER_TRANSFER / KVMESH_TRANSFER_PORT; the
    static-group settings of a fixed world (rank, world size, init address) do not exist:
    pairs of workers form on demand."""
    from kvmesh.cli import build_parser
    from worker.server.cli import PeerFlags, peer_flags, peer_flags_from_env

    def flags(argv: list[str], env: dict[str, str] | None = None) -> PeerFlags:
        return peer_flags(build_parser().parse_args(["worker", *argv]), env or {})
    assert flags([]) == PeerFlags(False, 0)
    assert flags(["--peer-transfer", "--transfer-port", "29600"]) == PeerFlags(True, 29600)
    assert flags([], {"KVMESH_PEER_TRANSFER": "1", "KVMESH_TRANSFER_PORT": "29601"}) == PeerFlags(True, 29601)
    assert peer_flags_from_env({"KVMESH_PEER_TRANSFER": "yes"}) == PeerFlags(True, 0)
    assert peer_flags_from_env({"KVMESH_RANK": "0", "KVMESH_WORLD_SIZE": "2"}) == PeerFlags(False, 0)
    for legacy in (["--rank", "1"], ["--world-size", "2"], ["--dist-init-addr", "h:1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["worker", *legacy])
    with pytest.raises(ValueError, match="KVMESH_TRANSFER_PORT"):
        peer_flags_from_env({"KVMESH_TRANSFER_PORT": "x"})


def test_worker_transfer_port_out_of_range_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--model", "smollm2", "--peer-transfer", "--transfer-port", "70000"]) == 2
    assert "--transfer-port" in capsys.readouterr().err


def test_worker_help_shows_the_liveness_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["worker", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--liveness-timeout-s" in out and "--max-step-failures" in out


@pytest.mark.parametrize(("extra", "flag"), [(["--liveness-timeout-s", "0"], "--liveness-timeout-s"),
                                             (["--max-step-failures", "0"], "--max-step-failures")])
def test_worker_liveness_flags_are_checked(extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--model", "smollm2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh worker: {flag}") and "\n" not in err, err
