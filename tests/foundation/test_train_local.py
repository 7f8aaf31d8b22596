"""The reference trainer learns, and checkpoints resume exactly."""

import pytest
import torch

from agora_node.compression import ActivationCodec
from agora_node.node.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from agora_node.node.cli import main
from agora_node.node.train_local import LocalTrainConfig, LocalTrainer, chain_forward
from agora_node.stages.data import TokenWindows
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import lm_loss

pytestmark = pytest.mark.timeout(240)


def _half_tiny():
    from agora_node.protocol.manifest import parse_manifest

    text = load_manifest("tiny").to_toml().replace("n_layers = 8", "n_layers = 4")
    return parse_manifest(text.replace("count = 4", "count = 2"))  # half of tiny: half the time


@pytest.mark.slow  # 30 s; the default suite's swarm-vs-reference test checks that the
# reference trainer learns (tests/integration/test_pipeline.py)
def test_train_local_lowers_validation_loss():
    m = _half_tiny()
    result = LocalTrainer(m, LocalTrainConfig(steps=30, eval_every=30, eval_samples=16)).run(
        report=lambda _: None
    )
    start, end = result.val_losses[0][1], result.val_losses[-1][1]
    # Observed: 5.61 -> ~2.6 (uniform over bytes is ln 256 = 5.55).
    assert start > 5.0 and end < 3.2, (start, end)


def test_resume_continues_exactly(tmp_path):
    m = _half_tiny()
    straight = LocalTrainer(m, LocalTrainConfig(steps=4, eval_every=100, eval_samples=4))
    straight.run(report=lambda _: None)

    cfg = dict(eval_every=100, eval_samples=4, checkpoint_dir=tmp_path, checkpoint_every=2)
    LocalTrainer(m, LocalTrainConfig(steps=2, **cfg)).run(report=lambda _: None)
    resumed = LocalTrainer(m, LocalTrainConfig(steps=4, **cfg))
    resumed.run(report=lambda _: None)
    assert resumed.optimizer.steps == 4
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_checkpoint_keeps_last_and_skips_corrupt(tmp_path):
    for step in range(1, 6):
        save_checkpoint(
            tmp_path,
            run_id="r",
            stage=1,
            step=step,
            state={"w": torch.full((3,), float(step))},
            keep=3,
        )
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 4, 3]
    # Corrupt the newest: loading falls back to the previous one.
    newest = list_checkpoints(tmp_path)[0].path
    newest.write_bytes(newest.read_bytes()[:-5] + b"xxxxx")
    info, state = load_latest_checkpoint(tmp_path, run_id="r", stage=1)
    assert info.step == 4 and state["w"][0] == 4.0
    assert load_latest_checkpoint(tmp_path, run_id="other", stage=1) is None
    # An uncommitted .pt (crash before its marker) is invisible.
    (tmp_path / "ckpt-000000009.pt").write_bytes(b"partial")
    assert list_checkpoints(tmp_path)[0].step == 4  # the damaged 5 was set aside (.corrupt)


def test_checkpoint_of_another_identity_is_not_loaded(tmp_path, caplog):
    def save(step: int, peer_id: str | None) -> None:
        state = {"w": torch.full((3,), float(step))}
        save_checkpoint(tmp_path, run_id="r", stage=0, step=step, state=state, peer_id=peer_id)

    save(1, None)  # written before checkpoints named their writer: still ours to resume
    save(2, "12D3KooWMine")
    save(3, "12D3KooWOther")  # the newest, but another node's (a shared data dir)
    info, state = load_latest_checkpoint(tmp_path, run_id="r", stage=0, peer_id="12D3KooWMine")
    assert (info.step, info.peer_id, float(state["w"][0])) == (2, "12D3KooWMine", 2.0)
    assert "written by peer 12D3KooWOther" in caplog.text
    info, _ = load_latest_checkpoint(tmp_path, run_id="r", stage=0, peer_id="12D3KooWNew")
    assert info.step == 1
    info, _ = load_latest_checkpoint(tmp_path, run_id="r", stage=0)  # no identity: no filter
    assert info.step == 3


def test_cli_train_local_prints_progress(capsys, tmp_path):
    assert (
        main(
            ["train-local", "--steps", "2", "--eval-every", "1", "--checkpoint-dir", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "step     1 | loss" in out and "tok/s" in out and "val_loss" in out
    assert list_checkpoints(tmp_path)[0].step == 2


def test_wire_in_the_loop_is_exact_for_fp32_and_rounds_for_int4():
    """chain_forward(wire=...) crosses each boundary as the daemons do: the sender's
    encode_boundary, the codec, the receiver's decode_boundary; exact in fp32."""
    m = _half_tiny()
    assert not m.dense  # the subspace boundary: k coefficients on the wire
    stages = LocalTrainer(m, LocalTrainConfig(steps=1)).stages
    batch = TokenWindows(m, "val").batch([0, 1])

    def logits_and_grad(wire):
        for p in stages[0].parameters():
            p.grad = None
        out = chain_forward(stages, batch, wire=wire)
        lm_loss(out, batch.targets).backward()
        grad = torch.cat([p.grad.flatten() for p in stages[0].parameters() if p.grad is not None])
        return out.detach(), grad

    exact, exact_grad = logits_and_grad(None)
    fp32, fp32_grad = logits_and_grad(ActivationCodec(mode="fp32"))
    int4, int4_grad = logits_and_grad(ActivationCodec(mode="int4"))
    torch.testing.assert_close(fp32, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fp32_grad, exact_grad, rtol=1e-3, atol=1e-5)
    assert (int4 - exact).abs().max() > 1e-3  # the first stage's gradient came through int4
    assert (int4_grad - exact_grad).norm() > 1e-3 * exact_grad.norm()
