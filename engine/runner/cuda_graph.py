"""CudaGraphRunner: the decode forward (model + logits) captured per batch size, then replayed.

Batch sizes 1, 2, 4, 8, 16, 24, ..., max_bs (SGLang's list); a batch is padded up to the next
captured size. Padding rows decode a dummy token at position 0 of req_to_token row 0 and write
their KV into slot 0, the pool's padding slot, so they never touch a live request's cache.
Graphs are captured largest first into one shared memory pool (a smaller graph's activations fit
in what the larger one left), at start-up, with a progress bar. The attention backend keeps its
per-batch metadata in static buffers it refreshes before each replay
(`init_forward_metadata_replay`, given the device and the host seq_lens); the sampler stays
outside the graph.

LoRA (the Triton path, engine/lora/lora_pool.py): with a pool the graphs are captured with the
LoRA kernels, reading a static per-token slot buffer the replay refills (padding rows and base-only
batches: slot -1, which no kernel reads or writes); the pool's buffers have fixed addresses, so
what is resident at capture does not matter. The torch path's passes run eagerly.

Memory: every graph writes its logits into one shared [max_bs, vocab] buffer (a graph per
size keeping its own output would hold ~6 GB at max_bs 512 and a 152k vocabulary). Sharing is
safe because everything runs on one stream: a step's sampling reads the buffer before the next
replay, enqueued after it, writes it. The shared pool can be the memory saver's "cuda_graph"
region (MemorySaver.graph_pool): a colocated release unmaps it and the graphs replay after resume.
The buffer is in the model's dtype, which the LM head's GEMM writes itself where it is cuBLAS's
(no copy). The tokens are the same; readers that widen to float32 first (sampling, top logprobs,
deterministic mode's log_softmax) see the same bits, while normal mode's fused greedy kernel sums a
bf16 chunk in another order than a float32 one, so a greedy logprob can differ in its last float32
bits from an eager step's (normal mode promises no bits across batch shapes anyway);
TANDEM_GRAPH_LOGITS=float32 copies and casts the output in the graph instead (the layout before;
H100, 0.6B 256 x (512, 256): 25,009 tok/s with it, 25,328 without).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time

import torch

from engine.kernels import env_choice
from engine.kernels.compile_ahead import compile_ahead_wanted, graphs_marker, mark_compiled
from engine.models.decoder import head_dim_of
from engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)
LOGITS_ENV = "TANDEM_GRAPH_LOGITS"


def logits_dtype(model: torch.nn.Module) -> torch.dtype:
    """The graphs' logits buffer: the LM head's dtype, or (TANDEM_GRAPH_LOGITS=float32) float32."""
    choice = env_choice(LOGITS_ENV, "model", ("model", "float32"), "model (the LM head's dtype, the default) or float32")
    return model.lm_head.weight.dtype if choice == "model" else torch.float32


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 above: padding stays under 6%."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, min(max_bs, 256) + 1, 8))
    sizes += list(range(272, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# the A/B of the in-graph decode block table: 1 launches it from the host each step, as before
TABLE_OUTSIDE_GRAPH = os.environ.get("TANDEM_TABLE_OUTSIDE_GRAPH") == "1"
# eager passes before each capture (kernel compiles, cuBLAS workspaces): one is enough (an H100,
# 8B shape: `tandem serve` ready 0.6 s sooner than with 2, SGLang's count); the A/B's switch
GRAPH_WARMUPS = int(os.environ.get("TANDEM_GRAPH_WARMUPS", "1"))
# the model's dims the decode kernels specialise on (the marker of their compile, not the layer count)
KERNEL_DIMS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "moe_intermediate_size", "num_experts", "num_experts_per_tok", "vocab_size", "tie_word_embeddings")

class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, kv_pool, req_to_token: torch.Tensor,
                 device: torch.device, max_bs: int, stream: torch.cuda.Stream | None = None,
                 lora_pool=None, deterministic: bool = False, graph_pool=None) -> None:
        self.model = model
        self.graph_pool = graph_pool  # (pool id, capture context): MemorySaver.graph_pool(), pauseable
        self.lora_pool = lora_pool
        self.deterministic = deterministic
        # one stream for every capture: cuBLAS keeps a workspace per stream it has seen
        self.stream = stream or (torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None)
        self.attn_backend = attn_backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.capture_bs = capture_batch_sizes(max_bs)
        self.max_bs = self.capture_bs[-1]
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices = (
            zeros(), zeros(), zeros(), zeros())
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.lora_slots = torch.full((self.max_bs,), -1, dtype=torch.int32, device=device)
        cfg = model.config
        attn_backend.init_cuda_graph_state(
            self.max_bs, req_to_token.shape[1], cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim_of(cfg), device)
        self.logits = torch.empty(self.max_bs, cfg.vocab_size, dtype=logits_dtype(model), device=device)
        self.num_replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def release(self) -> None:
        """Destroy the graphs now (their executables and their pool's hold), not whenever the
        last reference happens to go (at shutdown, before the pool is freed on the core thread)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        # the torch path's LoRA passes run eagerly (the graphs hold the pool's kernels only)
        lora = forward_batch.lora
        return (forward_batch.forward_mode.is_decode and forward_batch.batch_size <= self.max_bs
                and (lora is None or (self.lora_pool is not None and getattr(lora, "pool", None) is self.lora_pool)))

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """-> logits [bs, vocab] of the batch's rows (a view of the shared buffer, valid until the
        next replay; the model's dtype, or float32 under TANDEM_GRAPH_LOGITS=float32)."""
        fb = forward_batch
        bs = fb.batch_size
        padded = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        for static, value, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                                   (self.out_cache_loc, fb.out_cache_loc, 0),
                                   (self.req_pool_indices, fb.req_pool_indices, 0),
                                   (self.seq_lens, fb.seq_lens, 1)):
            static[:bs].copy_(value)
            if padded > bs:
                static[bs:padded].fill_(pad)
        if self.lora_pool is not None:  # each row's adapter slot; base rows and padding: -1
            if fb.lora is None:
                self.lora_slots[:padded].fill_(-1)
            else:
                self.lora_slots[:bs].copy_(fb.lora.token_slots)
                self.lora_slots[bs:padded].fill_(-1)
        # host lengths too: a backend that plans on the host (flashinfer) needs no device sync
        self.attn_backend.init_forward_metadata_replay(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded],
            fb.seq_lens_cpu + [1] * (padded - bs), shared_prefix=fb.shared_prefix)
        self.graphs[padded].replay()
        self.num_replays += 1
        return self.logits[:bs]

    # ---- capture -------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        from tqdm import tqdm

        start = time.perf_counter()
        # auto: only passes known to run dry safely (dense, no adapters: no torch op indexes with a
        # skipped kernel's output); TANDEM_COMPILE_AHEAD=1 takes any pass the backend can run dry
        dense = self.lora_pool is None and not getattr(self.model.config, "num_experts", None)
        marker = graphs_marker(self._kernel_shape()) if self.attn_backend.runs_dry and dense else None
        if self.attn_backend.runs_dry and compile_ahead_wanted(marker):
            with torch.inference_mode():
                self._compile_ahead()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = self.stream
        pool, capture_context = self.graph_pool or (torch.cuda.graph_pool_handle(), contextlib.nullcontext)
        bar = tqdm(list(reversed(self.capture_bs)), desc="Capturing CUDA graphs", unit="graph")
        with torch.inference_mode():
            for bs in bar:
                bar.set_postfix(bs=bs)
                self.graphs[bs] = self._capture(bs, stream, pool, capture_context)
        mark_compiled(marker)
        used = (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**30
        logger.info("captured %d CUDA graphs (bs %d..%d) in %.1f s, %.2f GB",
                    len(self.graphs), self.capture_bs[0], self.max_bs,
                    time.perf_counter() - start, used)

    def _kernel_shape(self) -> dict:
        """What the graphs' kernels specialise on besides their sources (graphs_marker's shape)."""
        cfg = self.model.config
        return {"dims": [getattr(cfg, name, None) for name in KERNEL_DIMS], "capture_bs": self.capture_bs,
                "dtype": str(next(self.model.parameters()).dtype), "kv": str(getattr(self.kv_pool, "dtype", None)),
                "deterministic": self.deterministic, "lora": self.lora_pool is not None,
                "backend": type(self.attn_backend).__name__}

    def _compile_ahead(self) -> None:
        """Every graph's Triton kernels compiled side by side first (a dry pass per size; the
        captures then load them from Triton's cache) instead of one by one inside the captures."""
        from engine.kernels.compile_ahead import CompileAhead

        ahead = CompileAhead()
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:  # on the capture's stream: its warm-ups reuse what the pass cached
            with ahead.dry_pass(), stream, self._end_layers_only():
                for bs in reversed(self.capture_bs):
                    fb = self._static_batch(bs)
                    self.attn_backend.init_forward_metadata_capture(bs, fb.req_pool_indices, fb.seq_lens)
                    ahead.run(lambda: self._forward(fb))  # False: stopped at a kernel compiled before
        except Exception as exc:  # what was handed over still helps; the captures say what is wrong
            logger.warning("compiling ahead stopped: %s: %s", type(exc).__name__, exc)
        report = ahead.wait()
        logger.info("compiled %d Triton kernels ahead of capture in %.1f s%s", report.submitted, report.seconds,
                    f" ({len(report.failed)} failed: {report.failed[0]})" if report.failed else "")

    @contextlib.contextmanager
    def _end_layers_only(self):
        """A dense decoder's layers launch the same kernels on the same shapes, so a dry pass
        through its first and last (whose epilogue reads the final norm) reaches every kernel the
        others would. Each Triton call in a dry pass costs hook work (its specialization serialised):
        35 walks through the 8B's 36 layers took 2.5 s of an H100's start with nothing to compile
        (through two layers: 1.2-2.2 s on another H100, the pool's loads from Triton's cache included)."""
        decoder = getattr(self.model, "model", None)
        layers = getattr(decoder, "layers", None)
        if getattr(self.model.config, "num_experts", None) or not isinstance(layers, torch.nn.ModuleList) \
                or len(layers) <= 2:
            yield
            return
        decoder.layers = torch.nn.ModuleList([layers[0], layers[-1]])
        try:
            yield
        finally:
            decoder.layers = layers

    def _capture(self, bs: int, stream: torch.cuda.Stream, pool, capture_context) -> torch.cuda.CUDAGraph:
        fb = self._static_batch(bs)
        self.attn_backend.init_forward_metadata_capture(bs, fb.req_pool_indices, fb.seq_lens)
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(stream):  # warm-up: kernel compiles, cuBLAS workspaces
            for _ in range(GRAPH_WARMUPS):
                self._forward(fb)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture_context(), torch.cuda.graph(graph, pool=pool, stream=stream):
            self._forward(fb)
        torch.cuda.synchronize(self.device)
        return graph

    def _forward(self, fb: ForwardBatch) -> None:
        """The captured work: model and logits, into the shared buffer's first bs rows."""
        if fb.lora is not None:  # the tokens' grouping by slot is part of the captured work
            fb.lora.begin_pass()
        if not TABLE_OUTSIDE_GRAPH:
            self.attn_backend.capture_replay_metadata(fb.batch_size, fb.seq_lens)  # plan work replayed on the device
        hidden = self.model(fb.input_ids, fb.positions, fb)
        self.model.compute_logits(hidden, out=self.logits[:fb.batch_size])

    def _static_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,  # values are only known at replay; nothing reads these
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        if self.lora_pool is not None:
            from engine.lora.pool_batch import LoRAPoolBatch

            fb.lora = LoRAPoolBatch(self.lora_pool, self.lora_slots[:bs], self.deterministic)
        return fb
