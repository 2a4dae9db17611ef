"""llm-compressor on the benchmark's calibration ids: its GPTQ recipe (GPTQModifier), GPTQ with
the ``imatrix_mse`` weight observer, or AWQ (AWQModifier then QuantizationModifier), written in
the compressed-tensors format. The lm_head is left in float, as every peer leaves it."""

from __future__ import annotations

from _child import Clock, arguments, calibration_ids

args = arguments()
ids = calibration_ids(args.ids)
clock = Clock()
import llmcompressor  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from llmcompressor.modifiers.transform.awq import AWQModifier  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

weights = {"num_bits": args.bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group_size}
if args.variant == "gptq-imatrix":
    weights["observer"] = "imatrix_mse"
groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
if args.variant == "awq":
    if not torch.accelerator.is_available():
        # 0.14's AWQ pins its cached activations for host-to-device copies, which a torch with no
        # accelerator refuses ("Cannot access accelerator device"); on the CPU there is no copy.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    asked = "AWQModifier defaults (duo scaling, 20-point grid), then round-to-nearest, sym"
else:
    recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    g = recipe[0]
    asked = f"GPTQModifier defaults: actorder {g.actorder}, dampening {g.dampening_frac}, block {g.block_size}, sym"
    if args.variant == "gptq-imatrix":
        asked += ", imatrix_mse observer"
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(args.model)
data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
oneshot(
    model=model,
    processor=tokenizer,
    dataset=data,
    recipe=recipe,
    num_calibration_samples=ids.shape[0],
    max_seq_length=ids.shape[1],
    shuffle_calibration_samples=False,
)
model.save_pretrained(args.out, save_compressed=True)
tokenizer.save_pretrained(args.out)
clock.finish(llmcompressor.__version__, f"{asked}, format compressed-tensors")
