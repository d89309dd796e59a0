"""The fast rollout engine: slot KV cache, continuous batching, CUDA-graph decode, sampling on the GPU.

Same `generate(...)` and results as the reference `RolloutEngine` (quarl/rollout/engine.py), built for speed on
one GPU (it also runs on the CPU, without graphs, which is how its equivalence is tested cheaply):

  * a slot KV cache (`fast_cache.SlotKVCache`) preallocated once: one row per running sequence, no padding;
  * admission: whole groups (a prompt and its n samples) are taken from the queue while n slots are free; their
    prompts are prefilled ONCE in one batched forward whose keys/values are written straight into the n slots of
    each prompt. The prompt's last token is not prefilled: the first decode step feeds it, so every sampled
    token comes from the same graph-captured step;
  * decode: one static-shape step (`fast_step.decode_step`) for slots 0..B-1, B the smallest batch bucket that
    covers the slots in use, captured once per bucket in a CUDA graph and replayed; sampling (with
    a seeded torch.Generator: inverse CDF from one uniform per sequence by default, or Gumbel-max) and behaviour
    log-probs are computed on the GPU and written to per-slot buffers;
  * the host looks at the state only every `sync_every` steps (one small device-to-host copy): it collects
    finished completions (EOS or length on the GPU; stop strings on the host), frees their slots and refills them
    from the queue (continuous batching). With the queue empty, the running sequences are moved into the lowest
    slots when that lets a smaller bucket run;
  * attention over the slot cache: a Triton split-KV decode kernel that reads only the filled columns
    (`quarl.kernels.decode_attention`), or the plain torch definition with a static column bound (CPU, or when
    the kernel fails its self-check).

Differences from the reference engine, by design: a finished sequence keeps its slot busy until the next sync
(at most sync_every - 1 wasted steps); `progress` is called at each sync with the tokens generated since the
last one; with the default inverse-CDF sampler the random stream differs (same seed -> same outputs within this
engine, not across engines); `sampler="gumbel"` draws the reference engine's tokens for the same seed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

import torch

from quarl.config import SAMPLERS
from quarl.fast_paths import FastPaths, fast_paths_of
from quarl.fallbacks import report_fallback
from quarl.model.moe import ExpertRouting, SparseMoeBlock
from quarl.model.tokenizer import eos_token_ids, right_padded
from quarl.rollout.engine import Completion, RequestOutput, RolloutEngine, _answer_seeds, _Sequence
from quarl.rollout.fast_attention import FP8_KV_DTYPE, make_decode_attention
from quarl.rollout.fast_cache import PrefillCacheWriter, SlotKVCache
from quarl.rollout.fast_step import DecodeState, decode_step
from quarl.rollout.fused_decode import FusedDecoder, fused_decode_supported
from quarl.rollout.sampling import SamplingParams
from quarl.rollout.seeding import counter_uniform

KV_BUCKET = 256  # column granularity of the torch attention path's static bound (one graph per bound)


def batch_buckets(num_slots: int) -> list[int]:
    """Batch sizes a decode step is captured for: powers of two up to 128, then multiples of 128, and num_slots."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < num_slots]
    sizes += list(range(256, num_slots, 128))
    return sorted(set(sizes + [num_slots]))


class FastRolloutEngine(RolloutEngine):
    """Generates groups of completions with a `QuarlForCausalLM` (see the module docstring)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 512, max_seq_len: int | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto", use_cuda_graphs: bool | None = None,
                 sync_every: int = 16, max_prefill_tokens: int = 32768, attention_backend: str = "auto",
                 fused_decode: bool | None = None, sampler: str = "inverse-cdf",
                 fast_paths: FastPaths | None = None, record_routing: bool = False):
        """
        Args:
            model: a QuarlForCausalLM (any device and dtype; CUDA + bf16 is the fast case).
            tokenizer: a Hugging Face tokenizer, or None for token-id prompts without stop strings.
            max_batch_size: number of KV slots = most sequences decoded at once (>= n of every call).
            max_seq_len: slot length (prompt + max_new_tokens - 1 must fit); None = sized by the first call
                that needs more (the cache is then reallocated).
            kv_cache_dtype: "auto" (the model dtype), "fp8" (E4M3, scale 1), "fp8-token" (E4M3 with a float32
                scale per token and kv head, see `fast_cache`) or a torch dtype.
            use_cuda_graphs: None = on for CUDA models.
            sync_every: decode steps between looks at the state from the host (>= 1).
            max_prefill_tokens: most (padded) prompt tokens in one prefill forward.
            attention_backend: "auto" (Triton where it runs, else torch), "triton" or "torch". A batch-invariant
                model (`QuarlForCausalLM.set_batch_invariant`) takes its own kernel ("invariant") and no fused
                decode, with the cache in its dtype: leave attention_backend, fused_decode and kv_cache_dtype unset.
            fused_decode: decode with q/k/v and gate/up fused into one GEMM each and the fused norm / rotary /
                SiLU·mul kernels (`fused_decode`, same values); None = on where the model supports it.
            sampler: how temperature sampling draws, both exact draws from the same distribution:
                "inverse-cdf" (default: one uniform per slot, no [slots, vocab] noise to write and read each
                step) or "gumbel"
                (Gumbel-max over a [slots, vocab] uniform tensor refilled every step: the reference engine's
                draws for the same seed).
            fast_paths: the optional decode paths (`quarl.fast_paths.FastPaths`: `lora_codes_handoff`,
                `stack_rollout_lora`); None = the model's (`model.fast_paths`, else the defaults). The CUDA
                graphs are keyed by it, so assigning another `engine.fast_paths` later captures anew.
            record_routing: fill `Completion.routing` with every fed token's experts (MoE models; router replay).
        """
        super().__init__(model, tokenizer, max_batch_size, record_routing)
        moe = getattr(model, "is_moe", False)
        if moe and fused_decode:
            raise ValueError("fused_decode=True does not cover mixture-of-experts MLPs; pass fused_decode=None or "
                             "False")
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 (a prompt token and a new one), got {max_seq_len}")
        if int(sync_every) != sync_every or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self._sampler = sampler  # fixed: the decode state's noise is allocated for it
        self.max_seq_len = None if max_seq_len is None else int(max_seq_len)
        self.kv_token_scales = kv_cache_dtype == "fp8-token"
        self.kv_dtype = self._kv_dtype("fp8" if self.kv_token_scales else kv_cache_dtype)
        self.use_cuda_graphs = model.device.type == "cuda" if use_cuda_graphs is None else bool(use_cuda_graphs)
        if self.use_cuda_graphs and model.device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs a model on a CUDA device")
        self.sync_every = int(sync_every)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.attention_backend = attention_backend
        if fused_decode and not fused_decode_supported(model):
            raise ValueError("fused_decode=True needs a model without per-head q/k norms (Qwen3 uses the module "
                             "path); pass fused_decode=None or False")
        # a batch-invariant model (`QuarlForCausalLM.set_batch_invariant`) decodes on its own module path and the
        # batch-invariant attention, so every step computes what its training forward computes
        self.batch_invariant = bool(getattr(model, "batch_invariant", False))
        if self.batch_invariant and (fused_decode or attention_backend != "auto" or self.kv_dtype != model.dtype):
            raise ValueError("a batch-invariant model decodes on its module path with the batch-invariant attention "
                             "over a cache in its own dtype; leave fused_decode, attention_backend and "
                             "kv_cache_dtype at their defaults")
        use_fused = (fused_decode_supported(model) if fused_decode is None else bool(fused_decode)) and \
            not self.batch_invariant
        self.fast_paths = fast_paths_of(model) if fast_paths is None else fast_paths
        if not isinstance(self.fast_paths, FastPaths):
            raise TypeError(f"fast_paths must be a quarl.fast_paths.FastPaths, got {type(fast_paths).__name__}")
        self._decoder = FusedDecoder.for_model(model, self.fast_paths) if use_fused else None
        self.num_slots = self.max_batch_size
        self.buckets = batch_buckets(self.num_slots)
        self.cache: SlotKVCache | None = None
        self.state: DecodeState | None = None
        self._attention = None
        self.attention_name: str | None = None
        self._graphs: dict = {}
        self._pool = None
        self._fingerprint = None
        # the model's modules, listed once: the fingerprint reads their tensors at every rollout, and the engine (like
        # its fused decoder) assumes the module tree it was built on
        self._modules = list(model.modules())
        self._graph_fingerprint = None  # the model's tensor addresses when the current graphs were captured
        self.last_stats: dict = {}

    def _kv_dtype(self, kv: str | torch.dtype) -> torch.dtype:
        if isinstance(kv, torch.dtype):
            return kv
        if kv == "auto":
            return self.model.dtype
        if kv == "fp8":
            if self.model.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"an FP8 KV cache needs a bf16/fp16/float32 model, not {self.model.dtype}")
            return FP8_KV_DTYPE
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8', 'fp8-token' or a torch dtype, got {kv!r}")

    # ------------------------------------------------------------------ public
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop: list[str] | None = None,
                 seed: int | None = None, progress: Callable[[int], None] | None = None, *,
                 ignore_eos: bool = False, seeds: Sequence[int] | None = None) -> list[RequestOutput]:
        """Sample n completions for every prompt; arguments and results as `RolloutEngine.generate` (seeds: one per
        prompt, each answer then draws from its own stream, `quarl.rollout.seeding`; the sampler's noise of slot s
        at its token t is counter_uniform(seed of the answer in s, t)).

        Extra: ignore_eos=True decodes past EOS up to max_new_tokens (benchmarks; finish_reason "length").
        `progress` is called at each host sync with the number of tokens generated since the previous call.
        """
        params = SamplingParams(float(temperature), float(top_p), int(top_k)).validate()
        prompt_ids = self._encode(prompts)
        self._check(prompt_ids, n, max_new_tokens, stop)
        n, max_new_tokens, stop = int(n), int(max_new_tokens), list(stop or [])
        if n > self.num_slots:
            raise ValueError(f"n={n} samples per prompt need n KV slots at once, but max_batch_size="
                             f"{self.num_slots}; raise max_batch_size to at least {n}")
        needed = max(len(p) for p in prompt_ids) + max_new_tokens - 1
        if self.max_seq_len is not None and needed > self.max_seq_len:
            raise ValueError(f"the longest prompt ({max(len(p) for p in prompt_ids)} tokens) + max_new_tokens="
                             f"{max_new_tokens} - 1 = {needed} exceeds max_seq_len={self.max_seq_len}; raise "
                             "max_seq_len or shorten the prompts")
        eos = [] if ignore_eos else eos_token_ids(self.tokenizer, self.model.config)
        device = self.model.device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        answer_seeds = _answer_seeds(seeds, len(prompt_ids), n)

        self.last_stats = {"graph_captures": 0, "capture_s": 0.0, "slot_moves": 0, "graph_drops": 0}
        self.model.set_rollout(True)
        try:
            with torch.no_grad():
                self._prepare(needed)
                st = self.state
                st.max_new.fill_(max_new_tokens)
                st.eos_mask.zero_()
                valid_eos = [e for e in eos if 0 <= e < st.eos_mask.numel()]
                if valid_eos:
                    st.eos_mask[torch.tensor(valid_eos, device=device)] = True
                outputs = _Run(self, prompt_ids, n, max_new_tokens, params, stop, set(eos), gen, progress,
                               answer_seeds).run()
            self._fingerprint = self._model_fingerprint()
        finally:
            self.model.set_rollout(False)
        return [RequestOutput(p if isinstance(p, str) else None, ids, outs)
                for p, ids, outs in zip(prompts, prompt_ids, outputs)]

    # ------------------------------------------------------------------ setup
    def _prepare(self, needed_columns: int) -> None:
        """Allocate (or grow) the slot cache and state; drop captured graphs if the model's tensors changed."""
        self._restack()  # what a reconfiguration replaced
        if bool(getattr(self.model, "batch_invariant", False)) != self.batch_invariant:
            raise RuntimeError("the model's batch_invariant setting changed after this engine was built (it decodes "
                               "as the model computed then); build a new FastRolloutEngine")
        if self._fingerprint is not None and self._fingerprint != self._model_fingerprint():
            self._drop_graphs()  # re-configured weights live in new buffers: the old graphs read stale memory
        if self.cache is not None and self.cache.capacity >= needed_columns:
            return
        capacity = self.max_seq_len or -(-needed_columns // 64) * 64
        model, c = self.model, self.model.config
        self.cache = self.state = None
        self._drop_graphs()
        self._check_memory(capacity)
        self.cache = SlotKVCache(c.num_layers, self.num_slots, c.num_kv_heads, c.head_dim, capacity, self.kv_dtype,
                                 model.device, token_scales=self.kv_token_scales)
        self.state = DecodeState.allocate(self.num_slots, capacity, c.vocab_size, model.device,
                                          torch.float64 if model.dtype == torch.float64 else torch.float32,
                                          noise_width=self._noise_width(), experts_shape=self._experts_shape())
        if self._attention is None:
            self._attention, self.attention_name = make_decode_attention(
                model.device, model.dtype, c.num_heads, c.num_kv_heads, c.head_dim, self.kv_dtype,
                self.cache.kv_scale, "invariant" if self.batch_invariant else self.attention_backend,
                self.kv_token_scales)

    def _experts_shape(self) -> tuple[int, int] | None:
        """(num_moe_layers, k) of the routing record, or None when not recording."""
        c = self.model.config
        return (len(c.moe_layers), c.num_experts_per_tok) if self.record_routing else None

    @property
    def sampler(self) -> str:
        """"gumbel" or "inverse-cdf", chosen at construction (see __init__)."""
        return self._sampler

    def _noise_width(self) -> int:
        """Uniform draws per slot and step: one per vocabulary entry (Gumbel-max) or one (inverse CDF)."""
        return 1 if self._sampler == "inverse-cdf" else self.model.config.vocab_size

    def _check_memory(self, capacity: int) -> None:
        c = self.model.config
        need = SlotKVCache.nbytes_for(c.num_layers, self.num_slots, c.num_kv_heads, c.head_dim, capacity,
                                      self.kv_dtype, self.kv_token_scales)
        need += self.num_slots * (self._noise_width() * 4 + capacity * 12)  # noise, out_tokens, out_logprobs
        if self.record_routing:  # out_experts, int16
            need += self.num_slots * capacity * 2 * len(c.moe_layers) * c.num_experts_per_tok
        if self.model.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.model.device)
        free += torch.cuda.memory_reserved(self.model.device) - torch.cuda.memory_allocated(self.model.device)
        if need > 0.95 * free:
            raise ValueError(
                f"the KV cache for max_batch_size={self.num_slots} slots x {capacity} columns needs "
                f"{need / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB are free; lower max_batch_size or "
                "max_seq_len, or use kv_cache_dtype='fp8'")

    def _restack(self) -> None:
        """Make the fused decoder's stacked weights and adapters current (`FusedDecoder.prepare`); if that moved
        any (adapter copies are not in the fingerprint), drop the CUDA graphs, which read the old ones."""
        if self._decoder is not None and self._decoder.prepare(self.fast_paths):
            self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool. A pool whose graphs are all gone may still hold
        blocks until the allocator frees them; capturing into it again trips the allocator's
        `use_count > 0` assertion, so the next capture starts a new pool."""
        if self._graphs:
            self.last_stats["graph_drops"] = self.last_stats.get("graph_drops", 0) + 1  # each costs re-captures
        self._graphs.clear()
        self._pool = None

    def _model_fingerprint(self) -> tuple:
        """Addresses of every parameter and buffer: a CUDA graph stays valid while none of them moves. Read from
        each module's own dicts, so a buffer a reconfiguration registers or replaces counts."""
        return tuple(t.data_ptr() for m in self._modules for tensors in (m._parameters, m._buffers)
                     for t in tensors.values() if t is not None)

    # ------------------------------------------------------------------ steps and graphs
    def kv_bound(self, columns: int) -> int:
        """Static attention column bound for `columns` filled columns (the capacity for the Triton kernels, which
        read each row's own length)."""
        cap = self.cache.capacity
        if self.attention_name in ("triton", "invariant"):
            return cap
        return min(cap, -(-columns // KV_BUCKET) * KV_BUCKET)

    def bucket(self, slots_in_use: int) -> int:
        for b in self.buckets:
            if b >= slots_in_use:
                return b
        return self.buckets[-1]

    def step(self, batch: int, kv_len: int, params: SamplingParams, gen: torch.Generator,
             slot_seeds: torch.Tensor | None = None) -> None:
        """One decode step for slots 0..batch-1 (a graph replay when graphs are on). slot_seeds: int64 [num_slots],
        the answer seed of each slot (per-answer streams), else `gen` draws the noise."""
        if not params.greedy:
            st = self.state
            if slot_seeds is None:
                st.noise[:batch].uniform_(generator=gen)
            else:  # draw t of an answer: its token index t is the slot's count of generated tokens
                st.noise[:batch].copy_(counter_uniform(slot_seeds[:batch], st.num_generated[:batch],
                                                       st.noise.shape[1]))
        if not self.use_cuda_graphs:
            decode_step(self.model, self.cache, self.state, self._attention, batch, kv_len, params, self._decoder)
            return
        key = self._graph_key(batch, kv_len, params)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(batch, kv_len, params)
            except Exception as e:  # keep generating, eagerly, and say so
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                report_fallback("cuda_graphs", f"CUDA graph capture failed ({reason}); decoding without graphs")
                self.last_stats["graph_error"] = reason
                self.use_cuda_graphs = False
                torch.cuda.synchronize(self.model.device)
                decode_step(self.model, self.cache, self.state, self._attention, batch, kv_len, params, self._decoder)
                return
        graph.replay()

    def _graph_key(self, batch: int, kv_len: int, params: SamplingParams) -> tuple:
        """What a captured step depends on besides the buffers: shapes, sampling, the decoder's mode and the
        fast paths, the engine's and the model's (a graph keeps the adapter path, codes handoff and MoE expert path
        it was captured with)."""
        return (batch, kv_len, params, self._decoder is not None and self._decoder.deferred_scales, self.fast_paths,
                fast_paths_of(self.model))

    def _capture(self, batch: int, kv_len: int, params: SamplingParams) -> torch.cuda.CUDAGraph:
        """Warm up (compiles kernels, builds lazy caches) and capture one step; the state is left unchanged.

        The warm-up writes only what the real step will overwrite with the same values (this step's cache
        column and output column), and the step counters are restored afterwards.
        """
        t0 = time.perf_counter()
        saved = [t.clone() for t in self.state.counters()]
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step(self.model, self.cache, self.state, self._attention, batch, kv_len, params, self._decoder)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.state.counters(), saved):
            t.copy_(s)
        host_bound = [layer.self_attn.layer_idx for layer in self.model.model.layers
                      if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.rollout_path_host_free]
        if host_bound:  # the warm-up chose each MoE layer's expert path for this rollout
            raise RuntimeError(
                f"the mixture-of-experts layers {host_bound[:4]} take the per-expert path, which reads token counts "
                "on the host (grouped paths: bf16 on Hopper, int8 / fp8 W8A8; docs/MOE.md)")
        self._restack()  # what the warm-up's fallbacks replaced, before capturing
        fingerprint = self._model_fingerprint()
        if fingerprint != self._graph_fingerprint:
            self._drop_graphs()  # graphs captured earlier read buffers that have moved since
            self._graph_fingerprint = fingerprint
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            decode_step(self.model, self.cache, self.state, self._attention, batch, kv_len, params, self._decoder)
        self._graphs[self._graph_key(batch, kv_len, params)] = graph
        self.last_stats["graph_captures"] = self.last_stats.get("graph_captures", 0) + 1
        self.last_stats["capture_s"] = self.last_stats.get("capture_s", 0.0) + time.perf_counter() - t0
        return graph

    def prefill(self, prompts: list[list[int]], slots: list[list[int]]) -> None:
        """Prefill prompt[:-1] of every prompt once (right-padded batch) into each of its slots."""
        model, device = self.model, self.model.device
        bodies = [p[:-1] for p in prompts]
        rows = [(i, s) for i, group in enumerate(slots) for s in group if bodies[i]]
        if rows:
            ids, mask = right_padded(bodies)
            keep = [i for i, b in enumerate(bodies) if b]  # 1-token prompts have nothing to prefill
            row_of = {i: r for r, i in enumerate(keep)}
            ids, mask = ids[keep], mask[keep]
            writer = PrefillCacheWriter(self.cache, torch.tensor([s for _, s in rows], device=device),
                                        torch.tensor([row_of[i] for i, _ in rows], device=device))
            routing = ExpertRouting(record=True) if self.record_routing else None
            model.hidden_states(ids.to(device), attention_mask=mask.to(device), kv_cache=writer, routing=routing)
            if self._graphs and getattr(model, "is_moe", False) and \
                    self._model_fingerprint() != self._graph_fingerprint:
                self._drop_graphs()  # this forward moved weights (a MoE block packed its experts'): stale graphs
            if routing is not None:  # each prompt's experts (right-padded rows) into each of its slots
                used = routing.stacked().to(self.state.out_experts.dtype)
                for i, s in rows:
                    self.state.out_experts[s, :len(bodies[i])] = used[row_of[i], :len(bodies[i])]
            # A projection that fell back to bf16 in this forward built its own dequantized cache, which
            # un-stacks its fused weight: stack again, else the decode steps run the parts one by one.
            self._restack()
        flat = [s for group in slots for s in group]
        idx = torch.tensor(flat, device=device)
        st = self.state
        st.slot_len[idx] = torch.tensor([len(p) - 1 for p, g in zip(prompts, slots) for _ in g], device=device)
        st.last_token[idx] = torch.tensor([p[-1] for p, g in zip(prompts, slots) for _ in g], device=device)
        st.num_generated[idx] = 0
        st.done[idx] = False

    def move_slots(self, src: list[int], dst: list[int], columns: int, generated: int) -> None:
        """Move running sequences from slots src to free slots dst (KV columns, counters, outputs)."""
        device = self.model.device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        self.cache.move(s, d, columns)
        st = self.state
        for t in st.counters():
            t[d] = t[s]
        st.out_tokens[d, :generated] = st.out_tokens[s, :generated]
        st.out_logprobs[d, :generated] = st.out_logprobs[s, :generated]
        if st.out_experts is not None:
            st.out_experts[d, :columns] = st.out_experts[s, :columns]
        st.done[s] = True


class _Run:
    """The host side of one generate call: queue, slot table, syncs, harvest (see the module docstring)."""

    def __init__(self, engine: FastRolloutEngine, prompt_ids, n, max_new, params, stop, eos, gen, progress,
                 answer_seeds: torch.Tensor | None = None):
        self.e, self.prompt_ids, self.n, self.max_new = engine, prompt_ids, n, max_new
        self.answer_seeds = answer_seeds  # int64 [P * n] (prompt-major) or None: one generator for all
        self.slot_seeds = None if answer_seeds is None else torch.zeros(
            engine.num_slots, dtype=torch.int64, device=engine.model.device)
        self.params, self.stop, self.eos, self.gen, self.progress = params, stop, eos, gen, progress
        self.queue = deque(range(len(prompt_ids)))
        S = engine.num_slots
        self.free = list(range(S))  # kept sorted: the lowest free slots are taken first
        self.owner: list[tuple[int, int] | None] = [None] * S  # slot -> (prompt index, sample index)
        self.bound = [0] * S  # host upper bound of the slot's filled columns (no sync needed)
        self.steps_left = [0] * S  # steps until the slot surely finishes (max_new_tokens reached)
        self.checked = [0] * S  # tokens already scanned for stop strings
        self.results: list[list[Completion | None]] = [[None] * n for _ in prompt_ids]
        self.window = 4 * max((len(s) for s in stop), default=0) + 4
        self.reported = [0] * S  # tokens of the slot already passed to `progress`
        self.prefill_events: list = []
        self.prefill_s = 0.0
        self.steps = 0

    def run(self) -> list[list[Completion]]:
        e = self.e
        st = e.state
        st.done.fill_(True)  # idle slots record nothing
        t0 = time.perf_counter()
        self.admit()
        while True:
            used = [s for s in range(e.num_slots) if self.owner[s] is not None]
            if not used:
                break
            batch = e.bucket(used[-1] + 1)
            k = max(1, min(e.sync_every, max(self.steps_left[s] for s in used)))
            for _ in range(k):
                kv_len = e.kv_bound(max(self.bound[s] for s in used) + 1)
                e.step(batch, kv_len, self.params, self.gen, self.slot_seeds)
                for s in used:
                    self.bound[s] += 1
                    self.steps_left[s] -= 1
                self.steps += 1
            self.sync(used)
            self.admit()
            if not self.queue:
                self.compact()
        if e.model.device.type == "cuda":
            torch.cuda.synchronize(e.model.device)
            self.prefill_s = sum(a.elapsed_time(b) for a, b in self.prefill_events) / 1e3
        kv_cache = "fp8-token" if e.kv_token_scales else str(e.kv_dtype).replace("torch.", "")
        e.last_stats.update(total_s=time.perf_counter() - t0, prefill_s=self.prefill_s, decode_steps=self.steps,
                            attention=e.attention_name, kv_cache=kv_cache, cuda_graphs=e.use_cuda_graphs)
        return self.results

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        """Move whole groups from the queue into free slots and prefill them (one forward)."""
        e = self.e
        picked, slots, width = [], [], 0
        while self.queue and len(self.free) >= self.n:
            L = len(self.prompt_ids[self.queue[0]])
            new_width = max(width, L)
            if picked and (len(picked) + 1) * new_width > e.max_prefill_tokens:
                break
            i = self.queue.popleft()
            group, self.free = self.free[:self.n], self.free[self.n:]
            picked.append(i)
            slots.append(group)
            width = new_width
            for j, s in enumerate(group):
                self.owner[s] = (i, j)
                self.bound[s] = L - 1
                self.steps_left[s] = self.max_new
                self.checked[s] = 0
                self.reported[s] = 0
        if not picked:
            return
        if self.slot_seeds is not None:
            flat = [s for group in slots for s in group]
            rows = [i * self.n + j for i in picked for j in range(self.n)]
            self.slot_seeds[torch.tensor(flat, device=self.slot_seeds.device)] = \
                self.answer_seeds[rows].to(self.slot_seeds.device)
        cuda = e.model.device.type == "cuda"
        if cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        else:
            t0 = time.perf_counter()
        e.prefill([self.prompt_ids[i] for i in picked], slots)
        if cuda:
            ev[1].record()
            self.prefill_events.append(ev)
        else:
            self.prefill_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ sync and harvest
    def sync(self, used: list[int]) -> None:
        """Read done / num_generated of the used slots (one copy), finish completions, free their slots."""
        st = self.e.state
        idx = torch.tensor(used, device=st.done.device)
        info = torch.stack([st.num_generated[idx], st.done[idx].long()]).cpu()
        generated, done = info[0].tolist(), info[1].tolist()
        tokens = logprobs = None
        need_rows = [r for r, s in enumerate(used) if done[r] or self.stop]
        if need_rows:
            width = max(max(generated[r] for r in need_rows), 1)
            rows = idx[torch.tensor(need_rows, device=idx.device)]
            tokens = dict(zip(need_rows, st.out_tokens[rows, :width].cpu().tolist()))
            logprobs = dict(zip(need_rows, st.out_logprobs[rows, :width].cpu().tolist()))
        stopped = []
        for r, s in enumerate(used):
            g = generated[r]
            finished = None
            if self.stop:
                finished = self._scan_stop(s, tokens[r][:g], logprobs[r][:g])
                if finished is not None:
                    stopped.append(s)
            if finished is None and done[r]:
                ids, lps = tokens[r][:g], logprobs[r][:g]
                if ids and ids[-1] in self.eos:
                    finished = Completion(ids, self.e._decode(ids[:-1]), lps, "eos")
                else:
                    finished = Completion(ids, self.e._decode(ids), lps, "length")
            if finished is not None:
                i, j = self.owner[s]
                if self.e.record_routing:  # every token fed: the prompt, then the answer but its last token
                    fed = len(self.prompt_ids[i]) + len(finished.token_ids) - 1
                    finished.routing = st.out_experts[s, :fed].to("cpu", copy=True)  # the slot is reused
                self.results[i][j] = finished
                self.owner[s] = None
                self.free.append(s)
        if stopped:  # the GPU may still think these run: mark them idle
            st.done[torch.tensor(stopped, device=st.done.device)] = True
        self.free.sort()
        if self.progress is not None:
            self.progress(sum(generated[r] - self.reported[s] for r, s in enumerate(used)))
        for r, s in enumerate(used):
            self.reported[s] = generated[r]

    def _scan_stop(self, slot: int, ids: list[int], lps: list[float]) -> Completion | None:
        """If a stop string ends at a token generated since the last scan, the completion up to that token."""
        start = self.checked[slot]
        self.checked[slot] = len(ids)
        if len(ids) == start:
            return None
        tail = self.e._decode(ids[max(0, start - self.window):])
        if not any(x in tail for x in self.stop):
            return None
        seq = _Sequence()
        for t in range(start, len(ids)):  # find the first token that completes a stop string
            seq.token_ids = ids[:t + 1]
            if ids[t] in self.eos:
                return None  # EOS came first: the EOS rule decides
            if self.e._hit_stop(seq, self.stop, self.window):
                return Completion(seq.token_ids, seq.text, lps[:t + 1], "stop")
        return None

    # ------------------------------------------------------------------ compaction
    def compact(self) -> None:
        """With the queue empty, move running sequences into the lowest slots when a smaller bucket would do."""
        e = self.e
        used = [s for s in range(e.num_slots) if self.owner[s] is not None]
        if not used or e.bucket(len(used)) >= e.bucket(used[-1] + 1):
            return
        m = len(used)
        src = [s for s in used if s >= m]
        dst = [s for s in range(m) if self.owner[s] is None][:len(src)]
        columns = max(self.bound[s] for s in src) + 1
        e.move_slots(src, dst, min(columns, e.cache.capacity), self.max_new)
        e.last_stats["slot_moves"] = e.last_stats.get("slot_moves", 0) + len(src)
        if self.slot_seeds is not None:
            device = self.slot_seeds.device
            self.slot_seeds[torch.tensor(dst, device=device)] = self.slot_seeds[torch.tensor(src, device=device)]
        for a, b in zip(src, dst):
            self.owner[b], self.owner[a] = self.owner[a], None
            for table in (self.bound, self.steps_left, self.checked, self.reported):
                table[b] = table[a]
        self.free = sorted(s for s in range(e.num_slots) if self.owner[s] is None)
