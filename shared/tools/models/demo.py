"""The demo model: a tiny Qwen2-VL trained here, on CPU, to answer questions about shapes.

``epd model train-demo DIR`` writes a Hugging Face model folder of the same architecture as the
random tiny test model (:mod:`shared.tools.models.tiny`: Qwen2-VL, Hub key layout, so both engines
and the vLLM connectors load it unchanged), its weights trained from scratch on the synthetic
scenes and questions of :mod:`shared.tools.models.shapes`. Seeded: the same seed, thread count and
machine give the same weights (float sums of batched kernels differ between CPU models, so another
machine trains a model that answers as well, not the same bytes).

The trained folder is committed (:data:`SHIPPED_DIR`, 8.9 MB) so ``make run`` serves it without
training. ``epd model train-demo`` trains a model from scratch (1800 steps, one torch thread: ~25
minutes on a free core); ``--init DIR`` (``python -m shared.tools.models.demo``) fine-tunes an
existing one instead, which is how the shipped folder was made: the model trained from scratch on
the narrower scenes of an earlier generator, fine-tuned on the current, wider ones, then on video
clips mixed with the images (docs/getting-started.md, "Demo model accuracy", has the recipe and the
figures). A clip is trained on the frames the API gives the encoder (:func:`clip_frames`: its mp4
decoded and sampled by :mod:`shared.video`), not on the drawn ones: the codec changes the pixels.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.tools.models import shapes
from shared.tools.models.tiny import (
    QWEN2_VL_CHAT_TEMPLATE,
    SizeSpec,
    _build_qwen2_tokenizer,
    _canonicalize_json_files,
    _qwen2_vl_config,
    _qwen2_vl_processor,
)

logger = logging.getLogger(__name__)

#: where the trained demo model is committed
SHIPPED_DIR = Path(__file__).resolve().parent / "qwen2-vl-shapes"
MODEL_NAME = "qwen2-vl-shapes"

SPEC = SizeSpec(
    description="demo: trained on synthetic shapes; vision 3x128, LM 4x128, 16-64 image tokens (2.2M params)",
    vision_layers=3,
    vision_dim=128,
    vision_heads=4,
    vision_mlp=512,
    lm_layers=4,
    lm_dim=128,
    lm_heads=4,  # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
    lm_kv_heads=4,
    lm_mlp=512,
    min_pixels=112 * 112,
    max_pixels=224 * 224,
)

# The tokenizer's merges are learned on the image questions and answers (so each answer is one
# token or two) plus the chat template's words. The video templates came later: their words are
# left out so the shipped model's tokenizer (and its embedding rows) stay as they are - a byte-level
# BPE encodes them in more pieces ("left" is three tokens).
_CORPUS = "\n".join(
    [
        *(q for t, qs in shapes.QUESTIONS.items() if t not in shapes.VIDEO_TEMPLATES for q in qs),
        *(f"{a} {a}. {a.capitalize()}" for a in shapes.IMAGE_ANSWERS),
        "system user assistant You are a helpful assistant.",
    ]
    * 4
)
_NUM_MERGES = 160

#: training seeds start here; held-out cases (tests, docs, ``epd up``'s example) use seeds below
TRAIN_SEED_BASE = 1_000_000
#: how often each template is drawn for training, in :class:`shapes.Template` order (shape and
#: count questions are the hard ones of the images; the clips' direction and colour come last)
TEMPLATE_WEIGHTS = (0.08, 0.22, 0.26, 0.10, 0.22, 0.12)
AUX_WEIGHT = 0.5
#: the share of training scenes whose sides are drawn log-uniformly (more small, elongated pictures)
LOG_SIDES_SHARE = 0.5
#: optimizer steps of `epd model train-demo`
DEFAULT_STEPS = 1800


def _messages(case: shapes.Case) -> list[dict[str, Any]]:
    part = {"type": "video" if case.video else "image"}
    return [{"role": "user", "content": case.content(image_part=lambda _s: part)}]


def clip_frames(clip: shapes.Clip) -> Any:
    """A clip's frames as the API hands them to the encoder: its mp4 decoded and sampled by
    :func:`shared.video.load_video` at the clip's own rate (what ``Case.chat_request`` asks),
    with the sampler of the folder's video processor - so training sees the codec's pixels."""
    from shared.video import VideoSampling, load_video, sampler_of_processor

    sampler = sampler_of_processor("Qwen2VLVideoProcessor")
    return load_video(clip.mp4(), sampler, VideoSampling(fps=clip.fps)).frames


def _batch(processor: Any, cases: list[shapes.Case], eos: str) -> dict[str, Any]:
    """Inputs and labels of ``cases``: the loss is on the answer and the end-of-turn token only."""
    import torch

    texts: list[str] = []
    images: list[Any] = []
    videos: list[Any] = []
    for case in cases:
        prompt = processor.apply_chat_template(_messages(case), add_generation_prompt=True, tokenize=False)
        texts.append(prompt + case.answer + eos)
        if case.video:
            videos.extend(clip_frames(s) for s in case.scenes)
        else:
            images.extend(s.render() for s in case.scenes)
    inputs = processor(
        text=texts,
        images=images or None,
        videos=videos or None,
        padding=True,
        padding_side="right",
        return_tensors="pt",
        do_sample_frames=False,
    )
    labels = torch.full_like(inputs["input_ids"], -100)
    lengths = inputs["attention_mask"].sum(dim=1)
    for i, case in enumerate(cases):
        k = len(processor.tokenizer(case.answer + eos, add_special_tokens=False)["input_ids"])
        end = int(lengths[i])
        labels[i, end - k : end] = inputs["input_ids"][i, end - k : end]
    inputs["labels"] = labels
    return inputs


def _scene_labels(cases: list[shapes.Case]) -> tuple[list[int], list[int], list[list[float]]]:
    """Per image, in the batch's image order: its shape's index (-100 unless it has one shape),
    its number of shapes - 1, and which colours it holds (multi-hot, :data:`shapes.COLOURS` order)."""
    shape_ids, counts, colours = [], [], []
    for case in cases:
        if case.video:
            continue
        for scene in case.scenes:
            one = len(scene.items) == 1
            shape_ids.append(shapes.SHAPES.index(scene.items[0].shape) if one else -100)
            counts.append(len(scene.items) - 1)
            held = {item.colour for item in scene.items}
            colours.append([float(c in held) for c in shapes.COLOURS])
    return shape_ids, counts, colours


class _AuxHeads:
    """Auxiliary classifiers on the vision tower's output (training only, not saved): each
    image's pooled tokens predict its shape, its number of shapes and the colours it holds; each
    clip's, its shape's direction and colour. They give the vision tower a direct signal for
    everything the LM must read off it (without them shape questions sat at chance for hundreds of
    steps while colour questions were solved; with shape and count alone, a run that drew fewer
    colour questions lost colour, 48%)."""

    def __init__(self, model: Any, dim: int):
        import torch

        self.shape = torch.nn.Linear(2 * dim, len(shapes.SHAPES))
        self.count = torch.nn.Linear(2 * dim, 3)
        self.colours = torch.nn.Linear(2 * dim, len(shapes.COLOURS))
        self.direction = torch.nn.Linear(2 * dim, len(shapes.DIRECTIONS))
        self.clip_colour = torch.nn.Linear(2 * dim, len(shapes.COLOURS))
        #: the vision tower's outputs of this step, in call order (images first, then videos)
        self.captured: list[Any] = []
        model.model.visual.register_forward_hook(self._hook)

    def _hook(self, _module: Any, _args: Any, output: Any) -> None:
        self.captured.append(output.pooler_output if hasattr(output, "pooler_output") else output)

    def parameters(self) -> list[Any]:
        heads = (self.shape, self.count, self.colours, self.direction, self.clip_colour)
        return [p for head in heads for p in head.parameters()]

    @staticmethod
    def _pooled(tokens: Any, grid_thw: Any) -> Any:
        import torch

        if isinstance(tokens, (tuple, list)):
            tokens = torch.cat(list(tokens))
        sizes = (grid_thw.prod(dim=1) // 4).tolist()
        return torch.stack([torch.cat([t.mean(0), t.amax(0)]) for t in torch.split(tokens, sizes)])

    def loss(self, inputs: dict[str, Any], cases: list[shapes.Case]) -> Any:
        import torch

        captured, self.captured = self.captured, []
        ce = torch.nn.functional.cross_entropy
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        total = torch.zeros(())
        if "image_grid_thw" in inputs:
            pooled = self._pooled(captured.pop(0), inputs["image_grid_thw"])
            shape_ids, counts, colours = _scene_labels(cases)
            total = total + (
                ce(self.shape(pooled), torch.tensor(shape_ids), ignore_index=-100)
                + ce(self.count(pooled), torch.tensor(counts))
                + bce(self.colours(pooled), torch.tensor(colours))
            )
        if "video_grid_thw" in inputs:
            pooled = self._pooled(captured.pop(0), inputs["video_grid_thw"])
            clips = [clip for case in cases if case.video for clip in case.scenes]
            directions = torch.tensor([shapes.DIRECTIONS.index(c.direction) for c in clips])
            colours_of = torch.tensor([list(shapes.COLOURS).index(c.scene.items[0].colour) for c in clips])
            total = total + ce(self.direction(pooled), directions) + ce(self.clip_colour(pooled), colours_of)
        return total


def _answer_accuracy(model: Any, processor: Any, cases: list[shapes.Case], eos: str) -> list[bool]:
    """Teacher-forced: per case, whether its every answer token is the argmax."""
    import torch

    inputs = _batch(processor, cases, eos)
    labels = inputs.pop("labels")
    with torch.no_grad():
        logits = model(**inputs).logits
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    ok = ((pred == target) | ~mask).all(dim=1)
    return [bool(x) for x in ok]


def _new_model(seed: int, init: Path | None = None) -> tuple[Any, Any]:
    """The processor (its tokenizer built here) and the model of the demo architecture: freshly
    initialised, or ``init``'s weights (a demo model folder, e.g. :data:`SHIPPED_DIR`)."""
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    tok = _build_qwen2_tokenizer(_CORPUS, _NUM_MERGES)
    config = _qwen2_vl_config(SPEC, tok)
    processor = _qwen2_vl_processor(SPEC, tok)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    if init is not None:
        loaded = Qwen2VLForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    return processor, model


def train_demo_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    batch_size: int = 24,
    lr: float = 2e-3,
    threads: int = 1,
    init: str | Path | None = None,
    template_weights: tuple[float, ...] = TEMPLATE_WEIGHTS,
) -> Path:
    """Train the demo model and write its folder into ``out_dir``; returns the folder.

    ``threads``: torch's intra-op threads. One by default: the result then does not depend on how
    many cores the machine has, and on a busy 2-core machine one thread trained 3-5x faster than
    two (measured: 0.8 vs 4 s a step while tests ran beside it). ``init``: start from this demo
    model folder's weights instead of random ones (fine-tuning it). ``template_weights``: how often
    each template is drawn (:class:`shapes.Template` order)."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    random.seed(seed)
    processor, model = _new_model(seed, Path(init) if init is not None else None)
    eos = "<|im_end|>"
    templates = list(shapes.Template)
    held_out = [shapes.make_case(t, i) for t in templates for i in range(16)]
    aux = _AuxHeads(model, SPEC.lm_dim)
    opt, sched = _optimizer(model, aux, lr=lr, steps=steps)
    started = time.monotonic()
    case_no = TRAIN_SEED_BASE + seed * 10_000_000
    rng = random.Random(seed)
    model.train()
    for step in range(steps):
        aux.captured.clear()
        cases = []
        for _ in range(batch_size):
            template = rng.choices(templates, template_weights)[0]
            cases.append(shapes.make_case(template, case_no, log_sides=rng.random() < LOG_SIDES_SHARE))
            case_no += 1
        inputs = _batch(processor, cases, eos)
        loss = model(**inputs).loss
        loss = loss + AUX_WEIGHT * aux.loss(inputs, cases)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            model.eval()
            _log_progress(model, processor, held_out, eos, step=step, steps=steps, loss=loss, started=started)
            model.train()
    model.eval()
    _write_model_folder(model, processor, out)
    logger.info("trained the demo model in %.0f s into %s", time.monotonic() - started, out)
    return out


def _optimizer(model: Any, aux: _AuxHeads, *, lr: float, steps: int) -> tuple[Any, Any]:
    """AdamW (weight decay on the matrices only, none on norms, biases and the auxiliary heads)
    and its schedule: a linear warm-up over the first 5 % of ``steps``, then a cosine down to 5 %."""
    import torch

    decay: list[Any] = []
    no_decay: list[Any] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.01},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": aux.parameters(), "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def _log_progress(
    model: Any, processor: Any, held_out: list[Any], eos: str, *, step: int, steps: int, loss: Any, started: float
) -> None:
    """The loss and the held-out answer accuracy, overall and per template (``model`` in eval mode)."""
    ok = _answer_accuracy(model, processor, held_out, eos)
    templates = list(shapes.Template)
    by_template = {t.value: sum(o for o, c in zip(ok, held_out) if c.template is t) / 16 for t in templates}
    logger.info(
        "step %d/%d loss %.4f held-out answer accuracy %.3f %s (%.0f s)",
        step,
        steps,
        float(loss.detach()),
        sum(ok) / len(ok),
        " ".join(f"{t}={a:.2f}" for t, a in by_template.items()),
        time.monotonic() - started,
    )


def _write_model_folder(model: Any, processor: Any, out: Path) -> None:
    """The trained model's folder: its weights (tensors in name order, mode 0644), configs and
    processor files, the JSON canonical (the same training writes the same bytes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="epd-demo-") as tmp:
        tmp_path = Path(tmp)
        model.save_pretrained(tmp_path / "model")
        with safe_open(str(tmp_path / "model" / "model.safetensors"), framework="pt") as fh:
            tensors = {name: fh.get_tensor(name).contiguous() for name in sorted(fh.keys())}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)
        for name in ("config.json", "generation_config.json"):
            shutil.copyfile(tmp_path / "model" / name, out / name)
        processor.save_pretrained(tmp_path / "processor")
        for path in sorted((tmp_path / "processor").iterdir()):
            shutil.copyfile(path, out / path.name)
    _canonicalize_json_files(out)
    assert processor.chat_template == QWEN2_VL_CHAT_TEMPLATE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the demo shapes model.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--init", help="start from this demo model folder's weights (fine-tune it)")
    parser.add_argument(
        "--weights",
        type=float,
        nargs=len(TEMPLATE_WEIGHTS),
        default=TEMPLATE_WEIGHTS,
        help="how often each template is drawn, in order: " + " ".join(t.value for t in shapes.Template),
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(
        train_demo_model(
            args.out_dir,
            seed=args.seed,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            threads=args.threads,
            init=args.init,
            template_weights=tuple(args.weights),
        )
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
