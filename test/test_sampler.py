"""Tests for infer/sampler.py (CPU, fast)."""

import pytest
import torch

from infer.sampler import Sampler, SamplingParams, _seed_keys, _uniform, uniform_reference


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _frequencies(probs_logits, params_fn, n_rows=2000, steps=10):
    """Draw n_rows*steps samples of one fixed distribution with distinct seeds per row."""
    logits = torch.as_tensor(probs_logits, dtype=torch.float32)
    V = logits.numel()
    s = Sampler(V, n_rows, "cpu")
    for i in range(n_rows):
        s.reset_slot(i, params_fn(i))
    slots = torch.arange(n_rows)
    batch = logits.expand(n_rows, V)
    counts = torch.zeros(V)
    for _ in range(steps):
        counts += torch.bincount(s.sample(batch, slots).tokens, minlength=V).float()
    return counts


def _chi2(counts, expected_probs):
    n = counts.sum()
    exp = torch.as_tensor(expected_probs, dtype=torch.float64) * n
    mask = exp > 0
    assert counts[~mask].sum() == 0, f"draws outside the support: {counts}"
    return float((((counts.double() - exp) ** 2)[mask] / exp[mask]).sum())


# ----------------------------------------------------------------------------- RNG
def test_rng_matches_python_reference_and_is_uniform():
    seeds = [0, 1, 42, 2**31 - 1, 2**32 + 5, 2**63 - 1, 123456789012345678]
    steps = [0, 1, 2, 1000, 2**31 + 7, 2**33 + 3]
    k1, k2, st, ref = [], [], [], []
    for sd in seeds:
        a, b = _seed_keys(sd)
        for n in steps:
            k1.append(a), k2.append(b), st.append(n), ref.append(uniform_reference(sd, n))
    u = _uniform(torch.tensor(k1), torch.tensor(k2), torch.tensor(st))
    assert u.tolist() == ref
    # bulk uniformity: mean, variance, and no repeats for consecutive steps of one seed
    a, b = _seed_keys(7)
    n = 200_000
    u = _uniform(torch.full((n,), a), torch.full((n,), b), torch.arange(n))
    assert ((u >= 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert _chi2(hist, [0.1] * 10) < 30
    assert u.unique().numel() > 0.99 * n


# ----------------------------------------------------------------------------- greedy
def test_greedy_equals_argmax_in_mixed_batch():
    V, B = 1000, 8
    s = Sampler(V, 16, "cpu")
    slots = torch.tensor([3, 9, 0, 15, 4, 7, 11, 2])
    for j, sl in enumerate(slots.tolist()):
        if j % 3 == 0:
            p = SamplingParams(temperature=0.0, seed=j)
        elif j % 3 == 1:
            p = SamplingParams(temperature=1.5, top_p=0.0, seed=j)
        else:
            p = SamplingParams(temperature=5.0, seed=j)  # genuinely sampled row
        s.reset_slot(sl, p)
    greedy_rows = torch.tensor([j % 3 != 2 for j in range(B)])
    g = _gen(0)
    sampled_not_argmax = 0
    for _ in range(20):
        logits = torch.randn(B, V, generator=g)
        tok = s.sample(logits, slots).tokens
        am = logits.argmax(1)
        assert torch.equal(tok[greedy_rows], am[greedy_rows])
        sampled_not_argmax += int((tok[~greedy_rows] != am[~greedy_rows]).sum())
    assert sampled_not_argmax > 10  # the sampled rows really are sampled


def test_top_k_1_equals_greedy():
    V, B = 500, 16
    s = Sampler(V, B, "cpu")
    for i in range(B):
        s.reset_slot(i, SamplingParams(temperature=3.0, top_k=1, seed=i))
    g = _gen(1)
    for _ in range(10):
        logits = torch.randn(B, V, generator=g)
        assert torch.equal(s.sample(logits, torch.arange(B)).tokens, logits.argmax(1))


def test_input_dtypes_fp16_bf16():
    V, B = 300, 4
    s = Sampler(V, B, "cpu")
    for i in range(B):
        s.reset_slot(i, SamplingParams(temperature=0.0))
    logits = torch.randn(B, V, generator=_gen(2))
    for dt in (torch.float16, torch.bfloat16):
        lg = logits.to(dt)
        assert torch.equal(s.sample(lg, torch.arange(B)).tokens, lg.float().argmax(1))


# ----------------------------------------------------------------------------- invalid ids
def test_invalid_ids_never_chosen():
    V, B = 65536, 8
    s = Sampler(V, B, "cpu")  # valid_vocab defaults to 65530
    params = [
        SamplingParams(temperature=0.0, logprobs=8),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=50.0, seed=2),
        SamplingParams(temperature=1.0, top_p=0.99, seed=3),
        SamplingParams(temperature=1.0, top_k=10, seed=4),
        SamplingParams(temperature=1.0, logit_bias={65533: 100.0}, seed=5),
        SamplingParams(temperature=1.0, alpha_presence=1.0, seed=6),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.5, seed=7),
    ]
    for i, p in enumerate(params):
        s.reset_slot(i, p)
    g = _gen(3)
    for _ in range(5):
        logits = torch.randn(B, V, generator=g)
        logits[:, 65530:] = 1e4  # the largest logits of all
        out = s.sample(logits, torch.arange(B))
        assert (out.tokens < 65530).all()
        assert (out.top_ids < 65530).all()
        assert out.tokens[0] == logits[0, :65530].argmax()


# ----------------------------------------------------------------------------- seeds
def _run_sequence(sampler, slot, params, logits_seq, batch_slots=None, extra=None):
    """Sample logits_seq[t] for `slot`; optionally inside a batch with other rows."""
    sampler.reset_slot(slot, params)
    toks = []
    for t, row in enumerate(logits_seq):
        if batch_slots is None:
            toks.append(int(sampler.sample(row[None], torch.tensor([slot])).tokens[0]))
        else:
            batch = extra[t].clone()
            pos = batch_slots.index(slot)
            batch[pos] = row
            toks.append(int(sampler.sample(batch, torch.tensor(batch_slots)).tokens[pos]))
    return toks


def test_seeded_reproducibility():
    V = 2000
    g = _gen(4)
    seq = [torch.randn(V, generator=g) * 2 for _ in range(200)]
    p = dict(temperature=1.0, top_p=0.95, alpha_frequency=0.1)
    a = _run_sequence(Sampler(V, 4, "cpu"), 0, SamplingParams(seed=1234, **p), seq)
    b = _run_sequence(Sampler(V, 4, "cpu"), 2, SamplingParams(seed=1234, **p), seq)
    c = _run_sequence(Sampler(V, 4, "cpu"), 0, SamplingParams(seed=1235, **p), seq)
    assert a == b
    assert sum(x != y for x, y in zip(a, c)) > 100
    # reset_slot restarts the step counter and penalties: same sequence again on reuse
    s = Sampler(V, 4, "cpu")
    assert _run_sequence(s, 1, SamplingParams(seed=1234, **p), seq) == a
    assert _run_sequence(s, 1, SamplingParams(seed=1234, **p), seq) == a
    # no seed => random seeds: two rows almost surely differ
    d = _run_sequence(Sampler(V, 4, "cpu"), 0, SamplingParams(**p), seq)
    e = _run_sequence(Sampler(V, 4, "cpu"), 0, SamplingParams(**p), seq)
    assert d != e


@pytest.mark.parametrize(
    "row_params",
    [
        dict(temperature=0.9, top_k=40, top_p=0.8, alpha_presence=0.3, alpha_frequency=0.2, alpha_decay=0.95),
        dict(temperature=1.3, top_p=0.9, alpha_frequency=0.5),  # top_p only: sort/staged path
        dict(temperature=1.1),  # no truncation
    ],
)
def test_batch_invariance(row_params):
    V, steps = 4096, 60
    g = _gen(5)
    seq = [torch.randn(V, generator=g) * 1.5 for _ in range(steps)]
    extra = [torch.randn(7, V, generator=g) * 1.5 for _ in range(steps)]
    params = SamplingParams(seed=987654321, **row_params)
    alone = _run_sequence(Sampler(V, 16, "cpu"), 0, params, seq)

    s = Sampler(V, 16, "cpu")
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.5, top_p=0.97, seed=1),  # flat: nucleus > staged K => sort
        SamplingParams(temperature=0.7, top_k=200, seed=2, logprobs=4),
        SamplingParams(temperature=1.0, seed=3, logit_bias={5: 3.0, 17: -2.0}),
        SamplingParams(temperature=1.0, top_k=1500, seed=4, alpha_presence=1.0),
        SamplingParams(temperature=0.5, top_k=7, top_p=0.5, seed=5),
    ]
    batch_slots = [12, 3, 7, 9, 1, 14, 6]
    ours = 9
    k = 0
    for sl in batch_slots:
        if sl != ours:
            s.reset_slot(sl, others[k])
            k += 1
    in_batch = _run_sequence(s, ours, params, seq, batch_slots, extra)
    assert alone == in_batch
    assert len(set(alone)) > 10


def test_staged_thresholds_equal_full_sort():
    """The top-K candidate path and the full-sort path give the same per-row threshold."""
    V, B = 3000, 64
    s = Sampler(V, B, "cpu")
    g = _gen(6)
    scale = torch.linspace(0.2, 6.0, B)[:, None]
    p = torch.softmax(torch.randn(B, V, generator=g) * scale, dim=1)
    top_k = torch.tensor([0, 5, 50, 0, 2000, 256, 0, 1] * 8)
    top_p = torch.tensor([0.9, 1.0, 0.7, 0.5, 0.95, 0.3, 1.0, 0.6] * 8)
    full, ok_full = s._thresholds(p, top_k, top_p, V)
    assert ok_full.all()
    part, ok = s._thresholds(p, top_k, top_p, 256)
    assert 0 < int(ok.sum()) < B  # both outcomes exercised
    assert torch.equal(part[ok], full[ok])
    # reference: standard nucleus on the top-k renormalized distribution
    for r in range(B):
        vals = p[r].sort(descending=True).values.double()
        k = int(top_k[r]) or V
        kept = vals[:k]
        if float(top_p[r]) < 1.0:
            cs = kept.cumsum(0) / kept.sum()
            n = int((cs < float(top_p[r])).sum()) + 1
            kept = kept[: min(n, k)]
        elif int(top_k[r]) == 0:
            assert full[r] == 0
            continue
        assert full[r] == kept[-1].float(), r


# ----------------------------------------------------------------------------- top-k / top-p / T
def test_top_k_never_outside_top_k():
    V, k = 300, 5
    g = _gen(7)
    logits = torch.randn(V, generator=g)
    counts = _frequencies(logits, lambda i: SamplingParams(temperature=1.0, top_k=k, seed=i), 1000, 5)
    top = logits.topk(k).indices
    expected = torch.zeros(V)
    expected[top] = torch.softmax(logits[top], 0)
    assert _chi2(counts, expected) < 25  # 4 dof; also asserts nothing outside the top k
    assert (counts[top] > 0).all()


@pytest.mark.parametrize(
    "probs, top_k, top_p, expected",
    [
        # standard nucleus keeps the boundary token fully: {0.4, 0.25, 0.15} renormalized.
        # (the peer's fractional rule would give 0.4/0.75, 0.25/0.75, 0.1/0.75)
        ([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], 0, 0.75, [0.5, 0.3125, 0.1875, 0, 0, 0]),
        # top-p is applied to the top-k renormalized distribution: top3 = .85, .45/.85 = .529,
        # .70/.85 = .824 >= .8 => keep 2
        ([0.45, 0.25, 0.15, 0.1, 0.05], 3, 0.8, [0.45 / 0.7, 0.25 / 0.7, 0, 0, 0]),
        # shuffled ids: truncation is by probability, not by position
        ([0.06, 0.25, 0.04, 0.4, 0.1, 0.15], 0, 0.75, [0, 0.3125, 0, 0.5, 0, 0.1875]),
    ],
)
def test_top_p_frequencies_match_standard_nucleus(probs, top_k, top_p, expected):
    logits = torch.tensor(probs).log()
    counts = _frequencies(logits, lambda i: SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=10_000 + i))
    dof = sum(e > 0 for e in expected) - 1
    assert _chi2(counts, expected) < 10 + 3 * dof  # ~p=0.01 region; wrong rules give hundreds


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_temperature(temp):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    counts = _frequencies(logits, lambda i: SamplingParams(temperature=temp, seed=77 + i))
    assert _chi2(counts, torch.softmax(logits / temp, 0)) < 20


def test_temperature_orders_concentration():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    lo = _frequencies(logits, lambda i: SamplingParams(temperature=0.5, seed=i), 500, 4)
    hi = _frequencies(logits, lambda i: SamplingParams(temperature=2.0, seed=i), 500, 4)
    assert lo[0] > hi[0] + 300 and lo[3] < hi[3]


# ----------------------------------------------------------------------------- penalties
def _penalty_reference(logits_seq, pres, freq, decay, bias=None):
    V = len(logits_seq[0])
    pen = [0.0] * V
    toks, pens = [], []
    for lg in logits_seq:
        adj = [lg[i] - pen[i] + (bias or {}).get(i, 0.0) for i in range(V)]
        t = max(range(V), key=lambda i: (adj[i], -i))
        old = pen[t]
        pen = [v * decay for v in pen]
        pen[t] += pres if old == 0.0 else freq
        toks.append(t)
        pens.append(list(pen))
    return toks, pens


def test_penalty_math_matches_reference():
    V, steps = 8, 25
    base = [1.0, 0.9, 0.75, 0.5, 0.2, 0.1, -0.5, -1.0]
    g = _gen(8)
    noise = (torch.randn(steps, V, generator=g) * 0.05).tolist()
    seq = [[b + n for b, n in zip(base, row)] for row in noise]
    pres, freq, decay = 0.7, 0.3, 0.9
    ref_toks, ref_pens = _penalty_reference(seq, pres, freq, decay, bias={2: 0.05})

    s = Sampler(V, 4, "cpu")
    s.reset_slot(2, SamplingParams(temperature=0.0, alpha_presence=pres, alpha_frequency=freq,
                                   alpha_decay=decay, logit_bias={2: 0.05}))
    s.reset_slot(0, SamplingParams(temperature=0.0))  # unpenalized neighbour in the batch
    for t in range(steps):
        lg = torch.tensor(seq[t])
        out = s.sample(torch.stack([lg, lg]), torch.tensor([2, 0]))
        assert int(out.tokens[0]) == ref_toks[t], t
        assert int(out.tokens[1]) == int(lg.argmax())
        torch.testing.assert_close(s.penalty[2], torch.tensor(ref_pens[t]), rtol=1e-5, atol=1e-6)
        assert (s.penalty[0] == 0).all()
    # the penalty really changed the greedy choice, and both presence and frequency were used
    assert len(set(ref_toks)) >= 3 and ref_toks[1] != ref_toks[0]
    assert any(ref_toks[i] in ref_toks[:i] for i in range(1, steps))
    # reset zeroes the table
    s.reset_slot(2, SamplingParams(temperature=0.0))
    assert (s.penalty[2] == 0).all()


def test_penalty_applies_before_temperature_on_sampled_rows():
    # With a huge presence penalty a sampled row can never repeat a token (while untouched ones
    # stay available), regardless of temperature.
    V, steps = 6, 6
    s = Sampler(V, 1, "cpu")
    s.reset_slot(0, SamplingParams(temperature=0.3, alpha_presence=100.0, alpha_frequency=100.0, seed=5))
    lg = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    toks = [int(s.sample(lg, torch.tensor([0])).tokens[0]) for _ in range(steps)]
    assert sorted(toks) == list(range(V))


# ----------------------------------------------------------------------------- bias / logprobs / NaN
def test_logit_bias_forces_and_bans():
    V, B = 50, 3
    s = Sampler(V, B, "cpu")
    s.reset_slot(0, SamplingParams(temperature=1.5, seed=1, logit_bias={7: 100.0}))
    s.reset_slot(1, SamplingParams(temperature=0.0, logit_bias={}))
    g = _gen(9)
    for _ in range(10):
        logits = torch.randn(B, V, generator=g)
        out = s.sample(logits, torch.tensor([0, 1, 2]))
        assert out.tokens[0] == 7
        assert out.tokens[1] == logits[1].argmax()
    # ban the argmax with a large negative bias: greedy takes the runner-up
    logits = torch.randn(1, V, generator=g)
    top2 = logits[0].topk(2).indices.tolist()
    s.reset_slot(2, SamplingParams(temperature=0.0, logit_bias={top2[0]: -100.0}))
    assert int(s.sample(logits, torch.tensor([2])).tokens[0]) == top2[1]
    with pytest.raises(ValueError):
        s.reset_slot(0, SamplingParams(logit_bias={V: 1.0}))


def test_logprobs_match_log_softmax_reference():
    V, B = 400, 4
    s = Sampler(V, 8, "cpu")
    slots = torch.tensor([5, 1, 6, 2])
    s.reset_slot(5, SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=3))
    s.reset_slot(1, SamplingParams(temperature=0.0, logprobs=5, alpha_presence=2.0))
    s.reset_slot(6, SamplingParams(temperature=1.0, seed=3, logit_bias={10: 5.0}))
    s.reset_slot(2, SamplingParams(temperature=1.2, top_k=20, seed=4, alpha_frequency=0.5))
    g = _gen(10)
    for _ in range(4):
        logits = torch.randn(B, V, generator=g) * 2
        pen = s.penalty[slots].clone()
        adj = logits - pen
        adj[2, 10] += 5.0
        ref = torch.log_softmax(adj, dim=1)
        out = s.sample(logits, slots)
        assert out.top_ids.shape == (B, 5) and out.top_logprobs.shape == (B, 5)
        torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1))
        torch.testing.assert_close(out.top_logprobs, ref.topk(5, dim=1).values)
        assert torch.equal(out.top_ids, ref.topk(5, dim=1).indices)
        assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
        torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_ids))
    assert s.penalty[1].abs().sum() > 0  # penalties were active in the reference above

    # nobody asks => nothing computed; want_logprob => chosen logprob only
    s2 = Sampler(V, 2, "cpu")
    s2.reset_slot(0, SamplingParams(temperature=0.0))
    lg = torch.randn(1, V, generator=g)
    out = s2.sample(lg, torch.tensor([0]))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    out = s2.sample(lg, torch.tensor([0]), want_logprob=True)
    assert out.top_ids is None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(lg, 1).max(1).values)


def test_nan_and_all_masked_rows():
    V, B = 64, 5
    s = Sampler(V, B, "cpu", valid_vocab=60)
    s.reset_slot(0, SamplingParams(temperature=0.0, logprobs=2))
    s.reset_slot(1, SamplingParams(temperature=2.0, seed=1))
    s.reset_slot(2, SamplingParams(temperature=1.0, seed=2))
    s.reset_slot(3, SamplingParams(temperature=1.0, seed=3, logit_bias={3: float("-inf")}))
    s.reset_slot(4, SamplingParams(temperature=0.0, top_p=0.5))
    g = _gen(11)
    for _ in range(20):
        logits = torch.randn(B, V, generator=g)
        nan_ids = torch.arange(0, V, 2)
        logits[0, nan_ids] = float("nan")  # NaN is not "the max"
        logits[1, nan_ids] = float("nan")
        logits[2] = float("nan")  # all NaN -> fallback, no crash
        logits[3] = float("-inf")
        logits[3, 3] = 1.0  # only finite id is biased away -> raw argmax fallback
        logits[3, 62] = 50.0  # ... but never an invalid id
        logits[4] = float("-inf")
        logits[4, 61] = 0.0  # only invalid ids are finite -> a valid id anyway
        out = s.sample(logits, torch.arange(B))
        t = out.tokens.tolist()
        assert t[0] == int(torch.nan_to_num(logits[0, :60], nan=-1e9).argmax())
        assert t[1] % 2 == 1 and t[1] < 60
        assert 0 <= t[2] < 60
        assert t[3] == 3
        assert 0 <= t[4] < 60
        assert not torch.isnan(out.logprobs).any()
        assert not torch.isnan(out.top_logprobs).any()
        assert out.logprobs[3] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_cuda_parity():
    V, B, steps = 65536, 48, 20
    k1, k2 = zip(*[_seed_keys(sd) for sd in range(B)])
    st = torch.arange(B) * 7919 + 2**32
    args = (torch.tensor(k1), torch.tensor(k2), st)
    assert torch.equal(_uniform(*args), _uniform(*(a.cuda() for a in args)).cpu())
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, alpha_presence=0.4, alpha_decay=0.99),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, logit_bias={11: 2.0}),
        SamplingParams(temperature=1.2, alpha_frequency=0.3),
        SamplingParams(temperature=2.0, top_k=2000),
        SamplingParams(temperature=0.7, top_p=0.5, logprobs=5),
    ]
    samplers = [Sampler(V, 2 * B, dev) for dev in ("cpu", "cuda")]
    for s in samplers:
        for i in range(B):
            p = params[i % len(params)]
            s.reset_slot(2 * i + 1, SamplingParams(**{**p.__dict__, "seed": i}))
    slots = torch.arange(B) * 2 + 1
    g = _gen(12)
    same = 0
    for _ in range(steps):
        x = torch.randn(B, V, generator=g) * 2
        x[:, :64] += torch.linspace(12, 3, 64)
        a = samplers[0].sample(x, slots)
        b = samplers[1].sample(x.cuda(), slots.cuda())
        same += int((a.tokens == b.tokens.cpu()).sum())
    # identical up to rare float-rounding differences at a CDF boundary (softmax ulps)
    assert same >= B * steps - 2


def test_graph_key_follows_the_live_slots_branches():
    """What a captured sampler graph fixes: whether any live row samples, any has penalties, and the bias tables'
    width while a row has biases; nothing can be captured without the kernel, with log-probabilities wanted or
    asked for by a live row, or on logits the kernel does not prepare (bf16, strided)."""
    V = 64
    logits = torch.zeros(4, V)
    s = Sampler(V, 4, "cpu", valid_vocab=V, impl="torch")
    assert s.graph_key(logits) is None  # no kernel (the torch path runs eagerly)
    s._kernel = object()  # stands in for the CUDA kernel: graph_key only asks whether there is one
    assert s.graph_key(logits) == (False, False, 0)
    s.reset_slot(0, SamplingParams(temperature=0, alpha_presence=0.5))
    assert s.graph_key(logits) == (False, True, 0)
    s.reset_slot(1, SamplingParams(temperature=0.7, logit_bias={3: 1.0, 4: -1.0, 5: 2.0}))
    assert s.graph_key(logits) == (True, True, s.bias_width) and s.bias_width == 3
    assert s.graph_key(logits, want_logprob=True) is None
    assert s.graph_key(logits.to(torch.bfloat16)) is None and s.graph_key(torch.zeros(V, 4).t()) is None
    s.reset_slot(2, SamplingParams(temperature=0.7, logprobs=2))
    assert s.graph_key(logits) is None
    s.release_slot(2)
    s.release_slot(1)  # no biased row left: the width no longer matters
    assert s.graph_key(logits) == (False, True, 0)
