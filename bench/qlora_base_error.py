"""How far a qlora base is from the full-precision model: KL(full || quantized) per token on B6's held-out task.

    python bench/qlora_base_error.py rtn gptq gptq-mse-scale gptq-sequential

Loads SmolLM2-135M-Instruct on the CPU (float32), quantizes its frozen base to NVFP4 as a qlora run of B6 does
(GPTQ rounds the weights to bf16 first, as on a GPU, and calibrates on the first 128 training prompts with their
gold answers; round-to-nearest quantizes the float32 weights, the CPU's compute dtype) and
prints the mean per-token KL(full || quantized) over the 256 held-out prompts followed by their gold answers: a
finer measure of what the base loses than held-out accuracy over 256 problems. It also prints the KL and the
top-1 agreement at the answer positions alone (the positions that predict each gold answer token), which decide
the accuracy but are a few percent of the tokens. Variants:

    rtn              every weight rounded to its nearest code
    gptq             `quarl.model.gptq` (the qlora default)
    gptq-mse-scale   GPTQ whose NVFP4 block scales are each the one of absmax/6, absmax/5, absmax/4 with the least
                     squared error on the block (as "four over six" scaling does)
    gptq-sequential  GPTQ whose every layer is calibrated on the outputs of the already quantized layers before it
                     (`quarl.model.gptq` calibrates every layer on the full-precision model's inputs)
    gptq-lora-init   GPTQ with the rank-32 LoRA adapters started as the correction of its error
                     (`lora.init=base_error`, `quarl.model.lora_init`): the qlora model at step 0
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from quarl.api import make_config
from quarl.bench.quality import SETTINGS, TASK
from quarl.config import parse_overrides
from quarl.formats import e2m1
from quarl.formats.fp4 import nvfp4_block_scale, nvfp4_codes
from quarl.model import gptq
from quarl.model.loading import load_model
from quarl.model.precision_apply import apply_precision, full_precision
from quarl.model.smoothing import calibration_batches, calibration_sequences, layer_input_groups
from quarl.model.tokenizer import encode_prompt
from quarl.tasks.task import load_task

VARIANTS = ("rtn", "gptq", "gptq-mse-scale", "gptq-sequential", "gptq-lora-init")
SCALE_MULTIPLIERS = (1.0, 1.2, 1.5)  # block max mapped to code 6, 5 and 4


class _NVFP4LeastSquaresScale(gptq._NVFP4):
    """GPTQ's NVFP4 grid choosing each block's scale by least squared error among SCALE_MULTIPLIERS x absmax/6."""

    def start_group(self, block: torch.Tensor) -> None:
        amax = block.abs().amax(dim=-1)
        best = best_err = None
        for m in SCALE_MULTIPLIERS:
            scale = nvfp4_block_scale(amax * m, self.row_global)
            step = (scale.to(torch.float32) * self.row_global)[..., None]
            err = (block - e2m1.decode(nvfp4_codes(block, step)) * step).pow(2).sum(-1)
            if best is None:
                best, best_err = scale, err
            else:
                better = err < best_err
                best = torch.where(better, scale.view(torch.uint8), best.view(torch.uint8)).view(scale.dtype)
                best_err = torch.minimum(err, best_err)
        self.block_scale = best
        self.scales.append(best)
        self.step = best.to(torch.float32) * self.row_global


@torch.no_grad()
def sequential_gptq(model, fmt: str, batches, weight_dtype: torch.dtype) -> dict:
    """GPTQ codes, each layer calibrated on the outputs of the quantized layers before it."""
    codes = {}
    with full_precision(model):
        states = [(*model.layer_inputs(ids, mask), mask.to(torch.bool).reshape(-1)) for ids, mask in batches]
        for layer in model.model.layers:
            groups = layer_input_groups(layer)
            before = list(states)
            hessians = gptq.layer_hessians(layer, groups, states)
            originals = {}
            for group, hessian in zip(groups, hessians):
                weights = [[lin.weight.detach().to(weight_dtype) for lin in group]]
                for lin, qt in zip(group, gptq.gptq_quantize_many(weights, hessian[None], fmt)[0]):
                    codes[lin], originals[lin] = qt, lin.weight.detach().clone()
                    lin.weight.copy_(qt.dequantize(torch.float32).to(lin.weight.dtype))
            states[:] = before
            gptq.layer_hessians(layer, [], states)  # the next layer's inputs, through this layer quantized
            for lin, weight in originals.items():
                lin.weight.copy_(weight)
    return codes


@torch.no_grad()
def log_probs(model, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(log-softmax float32 [B, T, V], attention mask [B, T])] per batch."""
    out = []
    for ids, mask in batches:
        logits = model(ids, attention_mask=mask)
        out.append((F.log_softmax(getattr(logits, "logits", logits).float(), -1), mask))
    return out


def answer_position_masks(prompt_lengths: list[int], batches) -> list[torch.Tensor]:
    """Per batch of right-padded prompt + gold answer sequences: bool [B, T - 1], true at the positions whose next
    token is a gold answer token (from the prompt's last token to the answer's second-to-last)."""
    masks, first = [], 0
    for ids, mask in batches:
        answer = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
        for row, length in enumerate(mask.sum(-1).tolist()):
            answer[row, prompt_lengths[first + row] - 1:length - 1] = True
        masks.append(answer)
        first += ids.shape[0]
    return masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", choices=VARIANTS)
    args = parser.parse_args()
    cfg = make_config(None, **parse_overrides([*TASK, *SETTINGS["qlora-nvfp4"], "model.device=cpu"]))
    model, tokenizer = load_model(cfg.model.name, dtype=torch.float32, progress=False)
    task = load_task(cfg.data, cfg.reward, tokenizer, seed=0)
    task.set_tokenizer(tokenizer)
    prompts = [encode_prompt(tokenizer, task.render(ex)) for ex in task.eval_examples[:256]]
    held_out = [p + list(tokenizer(str(ex.gold), add_special_tokens=False).input_ids)
                for p, ex in zip(prompts, task.eval_examples[:256])]
    batches = list(calibration_batches(held_out, "cpu", batch_size=64))
    answer_masks = answer_position_masks([len(p) for p in prompts], batches)
    reference = log_probs(model, batches)
    calibration = list(calibration_batches(calibration_sequences(task, tokenizer, gptq.CALIBRATION_PROMPTS), "cpu"))
    for variant in args.variants:
        quantized = copy.deepcopy(model)
        start = time.perf_counter()
        adapters: dict = {}
        if variant == "gptq-sequential":
            codes = sequential_gptq(quantized, "nvfp4", calibration, torch.bfloat16)
        elif variant.startswith("gptq"):
            grid = gptq._GRIDS["nvfp4"]
            if variant == "gptq-mse-scale":
                gptq._GRIDS["nvfp4"] = _NVFP4LeastSquaresScale
            try:
                codes = gptq.gptq_base(quantized, "nvfp4", calibration, weight_dtype=torch.bfloat16,
                                       adapters=adapters, adapter_rank=cfg.lora.rank if variant == "gptq-lora-init"
                                       else 0)
            finally:
                gptq._GRIDS["nvfp4"] = grid
        else:
            codes = {}
        seconds = time.perf_counter() - start
        apply_precision(quantized, cfg.precision)
        for linear, qt in codes.items():
            linear.load_frozen_base_codes(qt)
        for linear, (a, b) in adapters.items():
            linear.start_lora_at(a, b)
        kl = tokens = answer_kl = answer_tokens = answer_agree = 0.0
        for (ref, mask), (q, _), answer in zip(reference, log_probs(quantized, batches), answer_masks):
            real = mask[:, 1:].bool()  # positions whose next token is real
            per_token = (ref.exp() * (ref - q)).sum(-1)[:, :-1]
            kl += per_token[real].sum().item()
            tokens += real.sum().item()
            answer_kl += per_token[answer].sum().item()
            answer_tokens += answer.sum().item()
            answer_agree += (ref.argmax(-1)[:, :-1][answer] == q.argmax(-1)[:, :-1][answer]).sum().item()
        print(f"{variant}: mean KL(full || quantized) {kl / tokens:.4f} nats per token over {int(tokens)} tokens; "
              f"at the {int(answer_tokens)} answer positions KL {answer_kl / answer_tokens:.4f}, top-1 agreement "
              f"{answer_agree / answer_tokens:.3f} (quantizing took {seconds:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
