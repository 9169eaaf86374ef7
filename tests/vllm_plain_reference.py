"""A plain vLLM run, for tests to hold the project's vLLM engine against: ``vllm.LLM`` on a model
folder, each case sent through ``LLM.chat`` (vLLM's own chat template rendering, image loading
and sampling defaults; no code of the project), greedy, the tokenizer's special tokens added.
Runs as its own process (vLLM's engine core is a child process; a test must not keep a second
engine in its own)::

    python -m tests.vllm_plain_reference MODEL_DIR CASES_JSON OUT_JSON

``CASES_JSON``: ``{name: {"text": str, "images": [data URL, ...], "videos": [data URL, ...] (optional,
after the images), "max_tokens": int, "request": {...} (optional)}}``; a case with ``request`` (a
chat request's sampling fields) is sampled as vLLM's OpenAI server samples that request - its
``to_sampling_params`` with the defaults of the model's generation config (``--generation-config
auto``, the server's default) - every other case greedy with vLLM's neutral defaults;
``OUT_JSON`` gets ``{name: [token id, ...]}``. vLLM's folders go where ``VLLM_CACHE_ROOT`` etc.
point (the caller sets them).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(argv: list[str]) -> int:
    model_dir, cases_path, out_path = argv
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    with open(cases_path, encoding="utf-8") as fh:
        cases: dict[str, dict[str, Any]] = json.load(fh)
    # the flags of the plain server the issue compared with (`--enforce-eager --dtype float32
    # --max-model-len 4096`); everything else is vLLM's default
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=4096, seed=0)
    out: dict[str, list[int]] = {}
    for name, case in cases.items():
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in case["images"]]
        content += [{"type": "video_url", "video_url": {"url": url}} for url in case.get("videos", [])]
        content.append({"type": "text", "text": case["text"]})
        messages: list[Any] = [{"role": "user", "content": content}]
        if "request" in case:
            server_defaults = llm.llm_engine.model_config.get_diff_sampling_param()
            request = ChatCompletionRequest(model="m", messages=messages, **case["request"])
            sp = request.to_sampling_params(case["max_tokens"], server_defaults)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True)
        # the tokenizer's special tokens added to the rendered chat, as transformers' processor adds
        # them (and as vLLM's server does for a request with `"add_special_tokens": true`): vLLM's
        # chat default adds none, which leaves the tiny LLaVA (its template has no <s>) without BOS
        (result,) = llm.chat(messages, sp, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})
        out[name] = [int(t) for t in result.outputs[0].token_ids]
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
