"""Stage workers chained in one process train exactly like the reference trainer,
and a step between a micro-batch's forward and backward does not corrupt it."""

import pytest
import torch

from agora_node.node.train_local import LocalTrainConfig, LocalTrainer, chain_forward
from agora_node.node.worker import StageWorker
from agora_node.stages.manifest_files import load_manifest
from agora_node.stages.model import lm_loss
from agora_node.stages.optim import lag_beta1

pytestmark = pytest.mark.timeout(120)


def pipeline_microbatch(workers, mb_id, tokens, scale):
    c, sent = None, []
    for w in workers[:-1]:
        c = w.forward(mb_id, c, tokens)
        sent.append(w)
    loss, grad = workers[-1].forward_backward_last(c, tokens, scale)
    for w in reversed(sent):
        grad = w.backward(mb_id, grad)
    assert grad is None  # stage 0 has no upstream
    return loss


def test_chained_workers_match_reference_trainer():
    m = load_manifest("tiny")
    ref = LocalTrainer(m, LocalTrainConfig(steps=3, eval_every=100, eval_samples=2))
    workers = [StageWorker(m, s) for s in range(m.num_stages)]
    spec = m.inner
    n_micro = spec.local_batch // spec.micro_batch

    def local_batches(step):
        ids = [
            int(i)
            for i in ref.train.epoch_order(0)[
                step * spec.local_batch : (step + 1) * spec.local_batch
            ]
        ]
        return [
            ref.train.batch(ids[i * spec.micro_batch : (i + 1) * spec.micro_batch])
            for i in range(n_micro)
        ]

    # 1. Gradients of one local batch equal the reference's (before any step).
    for w in workers:
        w.micro_per_step = 10**9
    for i, batch in enumerate(local_batches(0)):
        pipeline_microbatch(workers, f"g/{i}", batch, 1 / n_micro)
        loss = lm_loss(chain_forward(ref.stages, batch), batch.targets)
        (loss / n_micro).backward()
    ref_params = dict(ref.model.named_parameters())
    for w in workers:
        for name, p in w.versions.held(0).items():
            torch.testing.assert_close(
                p.grad, ref_params[f"{w.index}.{name}"].grad, atol=1e-6, rtol=1e-4
            )

    # 2. Three inner steps: same losses and (up to Adam's amplification of float noise) weights.
    ref = LocalTrainer(m, LocalTrainConfig(steps=3, eval_every=100, eval_samples=2))
    workers = [StageWorker(m, s) for s in range(m.num_stages)]
    for step in range(3):
        ref_loss = ref.train_step()
        losses = [
            pipeline_microbatch(workers, f"{step}/{i}", b, 1 / n_micro)
            for i, b in enumerate(local_batches(step))
        ]
        assert abs(sum(losses) / n_micro - ref_loss) < 1e-4
    assert all(w.stats.steps == 3 and w.version == 3 for w in workers)
    ref_params = dict(ref.model.named_parameters())
    for w in workers:
        for name, p in w.stage.named_parameters():
            torch.testing.assert_close(p, ref_params[f"{w.index}.{name}"], atol=1e-4, rtol=1e-3)


def test_step_between_forward_and_backward_uses_stashed_weights():
    m = load_manifest("tiny")
    w0 = StageWorker(m, 0)  # stage 0 alone, fed synthetic downstream gradients
    tokens = torch.randint(0, 256, (m.inner.micro_batch, m.model.seq_len + 1))
    c = w0.forward("a", None, tokens)
    before = {n: p.detach().clone() for n, p in w0.versions.current.items()}
    # Two other micro-batches complete and trigger an inner step meanwhile.
    for mb in ("b", "c"):
        w0.forward(mb, None, tokens)
        w0.backward(mb, torch.randn_like(c))
    assert w0.stats.steps == 1 and w0.version == 1
    # "a" still backpropagates through the weights its forward used.
    grad = torch.randn_like(c)
    w0.backward("a", grad)
    assert w0.stats.stale_grads == 1
    ref = StageWorker(m, 0)
    with torch.no_grad():
        for n, p in ref.stage.named_parameters():
            p.copy_(before[n])
    ref.versions.publish(0)
    ref.forward("a", None, tokens)
    ref.backward("a", grad)
    for n, p in ref.versions.held(0).items():
        expected = p.grad
        if expected is None:
            continue
        got = w0.versions.held(0)[n].grad
        torch.testing.assert_close(got, expected)


def _stale_steps(worker, tokens, c_like, rounds):
    """A micro-batch forwarded, then a full step of others, then its backward: lag 1 each time."""
    for r in range(rounds):
        worker.forward(f"late{r}", None, tokens)
        for mb in ("b", "c"):
            worker.forward(f"{mb}{r}", None, tokens)
            worker.backward(f"{mb}{r}", torch.randn_like(c_like))
        worker.backward(f"late{r}", torch.randn_like(c_like))


def _stale_worker(**options):
    """A tiny stage-0 worker after 4 steps in which one micro-batch each landed a step late."""
    m = load_manifest("tiny")
    torch.manual_seed(0)
    w = StageWorker(m, 0, **options)
    tokens = torch.randint(0, 256, (m.inner.micro_batch, m.model.seq_len + 1))
    c = w.forward("probe", None, tokens)
    w.discard("probe")
    torch.manual_seed(1)
    _stale_steps(w, tokens, c, rounds=4)
    return m, w, tokens


def test_weight_prediction_extrapolates_the_last_step_by_the_measured_lag():
    m, w, tokens = _stale_worker(predict_weights=True)
    assert 0 < w.lag < 1  # a moving average of lags 0 and 1
    masters = dict(w.stage.named_parameters())
    move = w.versions._move
    assert any(d.abs().max() > 0 for d in move.values()), "the last step moved no weight"
    for name, copy in w.versions.current.items():
        expected = masters[name].detach() + w.lag * move[name] if name in move else masters[name]
        torch.testing.assert_close(copy.detach(), expected, msg=name)
    # validation reads the master weights, not the prediction
    plain = StageWorker(m, 0)
    with torch.no_grad():
        for n, p in plain.stage.named_parameters():
            p.copy_(masters[n])
    plain.versions.publish(0)
    torch.testing.assert_close(w.forward_eval(None, tokens), plain.forward_eval(None, tokens))
    # an outer step's write is not an inner step to extrapolate
    w._release(weights_changed=True)
    for name, copy in w.versions.current.items():
        assert torch.equal(copy.detach(), masters[name].detach()), name


def test_weight_prediction_changes_nothing_when_no_gradient_is_late():
    m = load_manifest("tiny")
    tokens = torch.randint(0, 256, (m.inner.micro_batch, m.model.seq_len + 1))
    grads = [torch.randn(m.inner.micro_batch, m.model.seq_len, 32) for _ in range(6)]
    workers = []
    for predict in (False, True):
        torch.manual_seed(0)
        w = StageWorker(m, 0, predict_weights=predict)
        for i, g in enumerate(grads):  # one micro-batch at a time: every forward is current
            c = w.forward(f"{i}", None, tokens)
            w.backward(f"{i}", g.reshape(c.shape))
        workers.append(w)
    off, on = workers
    assert on.lag == 0 and on.stats.steps == 3
    for (n, a), b in zip(off.stage.named_parameters(), on.stage.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_lag_momentum_lowers_adams_beta1_by_the_measured_lag():
    assert lag_beta1(0.9, 0.0) == pytest.approx(0.9)
    assert lag_beta1(0.9, 1.0) == pytest.approx(0.8)  # momenta compose: 1 - 0.1 * 2
    assert lag_beta1(0.9, 20.0) == 0.0 and lag_beta1(0.9, -1.0) == pytest.approx(0.9)
    m, w, _ = _stale_worker(lag_momentum=True)
    assert w.lag > 0
    (adam,) = w.optimizer.optimizers
    used = {g["betas"][0] for g in adam.param_groups}
    assert len(used) == 1 and m.inner.beta1 > used.pop() >= lag_beta1(m.inner.beta1, 1.0)
    _, plain, _ = _stale_worker()  # off: the manifest's beta1 whatever the lag
    assert plain.lag > 0
    assert {g["betas"][0] for g in plain.optimizer.optimizers[0].param_groups} == {0.9}


def test_recompute_when_graph_budget_is_exhausted():
    m = load_manifest("tiny")
    kept, recomputed = StageWorker(m, 0), StageWorker(m, 0, max_graphs=0)
    tokens = torch.randint(0, 256, (4, m.model.seq_len + 1))
    ca = kept.forward("x", None, tokens)
    cb = recomputed.forward("x", None, tokens)
    torch.testing.assert_close(ca, cb)
    grad = torch.randn_like(ca)
    kept.backward("x", grad)
    recomputed.backward("x", grad)
    assert recomputed.stats.recomputed == 1
    for (n, a), b in zip(
        kept.versions.held(0).items(),
        recomputed.versions.held(0).values(),
        strict=True,
    ):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_tokens_count_once_per_microbatch_at_every_stage():
    """Forward and backward of a micro-batch are one measurement: the same token count at
    every stage, over the micro-batch's forward + backward seconds."""
    m = load_manifest("tiny")
    workers = [StageWorker(m, s) for s in range(m.num_stages)]
    for w in workers:
        w.micro_per_step = 10**9  # no optimizer step: only the accounting is under test
    tokens = torch.randint(0, 256, (m.inner.micro_batch, m.model.seq_len + 1))
    n = 3
    for i in range(n):
        pipeline_microbatch(workers, f"m{i}", tokens, 1 / n)
    per_mb = m.inner.micro_batch * m.model.seq_len
    for w in workers:
        s = w.stats
        assert (s.microbatches, s.tokens, s.trained_tokens) == (n, n * per_mb, n * per_mb)
        # Nothing else ran: the rate is all tokens over all compute seconds.
        assert s.compute_rate == pytest.approx(s.tokens / s.compute_s, rel=1e-9)
        assert s.throughput == s.compute_rate  # what the record announces
        assert 0 < s.utilization <= 1


def test_discarded_and_validation_work_is_busy_time_not_rate():
    m = load_manifest("tiny")
    w = StageWorker(m, 0)
    tokens = torch.randint(0, 256, (m.inner.micro_batch, m.model.seq_len + 1))
    w.forward("lost", None, tokens)
    w.discard("lost")  # downstream never answered
    w.forward_eval(None, tokens)
    assert w.stats.compute_s > 0 and w.stats.tokens == 0 and w.stats.compute_rate == 0


def test_a_backward_out_of_memory_part_way_leaves_no_partial_gradient_for_the_step():
    """A backward that failed part way left its later layers' gradients on the version
    copy, and the next micro-batch finished on that copy handed them to the step."""
    m = load_manifest("tiny")
    failing, clean = StageWorker(m, 0), StageWorker(m, 0)
    tokens = [torch.randint(0, 256, (4, m.model.seq_len + 1)) for _ in range(3)]
    copy = failing.versions.current
    first = next(iter(copy))  # forward's first parameter: its gradient comes last
    armed = {"oom": False}

    def fail_once(_param) -> None:  # noqa: ANN001
        if armed.pop("oom", False):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    copy[first].register_post_accumulate_grad_hook(fail_once)
    failing.backward("a", torch.ones_like(failing.forward("a", None, tokens[0])))
    c = failing.forward("b", None, tokens[1])
    armed["oom"] = True
    with pytest.raises(torch.OutOfMemoryError):
        failing.backward("b", torch.ones_like(c))
    assert all(p.grad is None for p in copy.values())
    # "a" finished on the copy and went with it: no token of it counts as trained
    assert failing.stats.trained_tokens == 0
    for w in (failing, clean):
        w.backward("c", torch.ones_like(w.forward("c", None, tokens[2])))
    for name, p in clean.versions.held(0).items():
        torch.testing.assert_close(failing.versions.held(0)[name].grad, p.grad, msg=name)
    assert failing.stats.trained_tokens == clean.stats.trained_tokens == tokens[2][:, 1:].numel()
    failing.close()
    clean.close()


def test_gradients_dropped_by_an_adopted_anchor_do_not_count_as_trained():
    """Tokens trained are those whose gradient can reach a step (the outer step's weight
    and the record's tokens_seen): adopting an anchor lets go of those not yet stepped."""
    m = load_manifest("tiny")
    w = StageWorker(m, 0)
    w.micro_per_step = 10**9  # no inner step
    tokens = torch.randint(0, 256, (4, m.model.seq_len + 1))
    for mb in ("a", "b"):
        w.backward(mb, torch.ones_like(w.forward(mb, None, tokens)))
    assert w.stats.trained_tokens == 2 * tokens[:, 1:].numel()
    w.adopt_anchor(torch.cat([p.detach().flatten() for p in w.masters]))
    assert w.stats.trained_tokens == 0
    w.backward("c", torch.ones_like(w.forward("c", None, tokens)))
    assert w.stats.trained_tokens == tokens[:, 1:].numel()
    w.close()
