"""Where a decode step's time goes (`quarl bench rollout --breakdown`): whole step vs its parts, on the GPU.

With a warmed-up FastRolloutEngine, every slot is set mid-generation (`context` filled columns) and four pieces
are timed as CUDA-graph replays (events around `reps` replays, mean per replay):
  step       the engine's captured decode step (noise refill included), as in generation;
  linears    every QuantLinear of the decoder layers + lm_head on [batch, in] inputs (the rollout path; with the
             fused decode its stacked GEMMs, on 8-bit codes made beforehand where the step hands codes over);
  attention  the decode attention of every layer over `context` + 1 columns;
  sampling   the refill of the step's uniform draws and its sampler (`fast_step.sample_next`) on [batch, vocab]
             logits in the model dtype;
  other      step - (linears + attention + sampling): norms, rotary, cache writes, residuals, embeddings.
Each part is also given its bandwidth floor: bytes it must read / the measured copy bandwidth; the linears
also their compute floor, 2 * weights * batch / matrix rate.
"""

from __future__ import annotations


def _graph_ms(torch, fn, reps: int = 20, calls: int = 1) -> float:
    """Mean milliseconds of one call of fn, from replays of a CUDA graph of `calls` back-to-back calls (one eager
    warm-up call first; several calls spread the graph launch over them, as between a decode step's kernels)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps * calls)


def _fused_linear_runs(decoder, model, inputs: dict, batch: int) -> list:
    """The GEMMs of the fused decode step as it runs them, one callable each: q/k/v and gate/up stacked, and
    where the norm or SiLU·mul kernel hands a GEMM 8-bit activation codes, that GEMM on codes made beforehand (the
    step quantizes inside those kernels, which "other" counts); o_proj and lm_head on bf16 inputs, quantizing
    them themselves as in the step."""
    from quarl.rollout.fused_decode import linear_codes_handoff, linear_from
    from quarl.rollout.fused_decode import reference_codes as codes_of

    def stacked(proj):  # a FusedProjection: on codes where the norm kernel hands it codes
        x = inputs[proj.in_features]
        fmt = proj.codes_handoff(batch)
        return (lambda c=codes_of(x, fmt): proj(None, c)) if fmt else (lambda: proj(x))

    def down_run(down):  # down_proj: on codes where the SiLU·mul kernel hands it codes
        x = inputs[down.in_features]
        fmt = linear_codes_handoff(down, batch, decoder.fast_paths)
        return (lambda c=codes_of(x, fmt): linear_from(down, None, c)) if fmt else (lambda: down(x))

    def plain(linear):  # its input arrives in bf16: the linear quantizes it itself
        return lambda: linear(inputs[linear.in_features])

    runs = []
    for layer, qkv, gate_up in zip(model.model.layers, decoder.qkv, decoder.gate_up):
        runs += [stacked(qkv), plain(layer.self_attn.o_proj), stacked(gate_up), down_run(layer.mlp.down_proj)]
    return runs + [plain(model.lm_head)]


def step_breakdown(torch, engine, model, batch: int, context: int, params, bandwidth: float,
                   matrix_rate: float) -> dict:
    """Times (ms) of the step and its parts at `batch` running slots of `context` filled columns; see above.

    matrix_rate: FLOP/s of the linears' tensor cores (2x bf16 for W8A8) for their compute floor.
    """
    from quarl.model.qlinear import QuantLinear
    from quarl.bench.rollout import kv_bytes_per_element
    from quarl.rollout.fast_step import sample_next

    cfg, st, cache = model.config, engine.state, engine.cache
    dev, dtype = model.device, model.dtype
    out: dict = {}
    with torch.no_grad():
        model.set_rollout(True)
        try:
            st.slot_len[:batch] = context
            st.num_generated[:batch] = 0
            st.done[:batch] = False
            st.max_new.fill_(2**40)  # never finish while timed
            gen = torch.Generator(device=dev).manual_seed(0)
            kv_len = engine.kv_bound(context + 40)
            reps = 20
            for _ in range(2):
                engine.step(batch, kv_len, params, gen)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                engine.step(batch, kv_len, params, gen)
            end.record()
            end.synchronize()
            out["step_ms"] = start.elapsed_time(end) / reps

            linears = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)] + [model.lm_head]
            inputs = {k: torch.randn(batch, k, device=dev, dtype=dtype) for k in {m.in_features for m in linears}}
            runs = [lambda c=c: c(inputs[c.in_features]) for c in linears]
            if engine._decoder is not None:
                runs = _fused_linear_runs(engine._decoder, model, inputs, batch)
            out["linears_ms"] = _graph_ms(torch, lambda: [run() for run in runs])

            q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
            lengths = torch.full((batch,), context + 1, device=dev, dtype=torch.long)
            att = engine._attention
            out["attention_ms"] = _graph_ms(torch, lambda: [att(q, cache.keys[i], cache.values[i], lengths, kv_len,
                                                                *cache.scales(i)) for i in range(cfg.num_layers)])

            logits = torch.randn(batch, cfg.vocab_size, device=dev, dtype=dtype)
            u = torch.rand(batch, engine._noise_width(), device=dev)  # [B, V] Gumbel-max, [B, 1] inverse CDF

            def draw():
                if params.greedy:
                    return sample_next(logits, params, None)
                u.uniform_()
                return sample_next(logits, params, u)

            out["sampling_ms"] = _graph_ms(torch, draw)
        finally:
            model.set_rollout(False)
            st.done.fill_(True)
    out["other_ms"] = out["step_ms"] - out["linears_ms"] - out["attention_ms"] - out["sampling_ms"]
    weight_bytes = sum(_linear_bytes(m) for m in linears)
    # the cache's own element size ("auto" = the stored dtype's), plus the per-token scales of an fp8-token cache
    kv_item = kv_bytes_per_element("fp8-token" if cache.token_scales else "auto", cfg.head_dim,
                                   cache.keys[0].element_size())
    kv_bytes = batch * (context + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
    out["linears_floor_ms"] = 1e3 * weight_bytes / bandwidth
    out["linears_compute_floor_ms"] = 1e3 * 2.0 * sum(m.in_features * m.out_features for m in linears) * batch \
        / matrix_rate
    out["attention_floor_ms"] = 1e3 * kv_bytes / bandwidth
    # logits read once; Gumbel-max also writes and reads a float32 uniform per logit (copy bandwidth counts reads
    # and writes), inverse CDF reads the logits about once more per row range it scans (~1/8 at batch 512)
    per_logit = dtype.itemsize + 8 if engine._noise_width() > 1 else dtype.itemsize * 1.125
    out["sampling_floor_ms"] = 1e3 * batch * cfg.vocab_size * per_logit / bandwidth
    out["context"], out["batch"] = context, batch
    return out


def _linear_bytes(m) -> int:
    if m.rollout_format is not None and m.qweight_data is not None:
        parts = (m.qweight_data, m.qweight_scale, m.qweight_global_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
    return m.weight.numel() * m.weight.element_size()


def format_breakdown(b: dict) -> str:
    """One line: each part's time and its bandwidth floor."""
    return (f"step {b['step_ms']:.2f} ms at batch {b['batch']}, context {b['context']}: "
            f"linears {b['linears_ms']:.2f} (floor {b['linears_floor_ms']:.2f}, compute "
            f"{b.get('linears_compute_floor_ms', float('nan')):.2f}), "
            f"attention {b['attention_ms']:.2f} (floor {b['attention_floor_ms']:.2f}), "
            f"sampling {b['sampling_ms']:.2f} (floor {b['sampling_floor_ms']:.2f}), other {b['other_ms']:.2f}")
