"""The one factory for vLLM 0.32 chat-completion answers (wire-formats §1.2).

Every dialect, SSE and extraction test builds its upstream answer here: the exact JSON vLLM
0.32 returns with ``return_token_ids`` and ``return_tokens_as_token_ids`` (ids inline on the
choice, ``token_id:<id>`` log-prob entries, the prompt's ids at the top level).  A test states
only what it varies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The §1.2 run's 36-token prompt (SmolLM2's chat template around "Say hi in three words.").
SMOL_PROMPT_IDS = [
    *(1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28),
    *(7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 281, 1296),
    *(1924, 30, 2, 198, 1, 520, 9531, 198),
]


def vllm_chat_answer(
    content: str | None,
    token_ids: Sequence[int],
    *,
    log_probs: float | Sequence[float] | None = None,
    finish_reason: str = "stop",
    stop_reason: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    prompt_ids: Sequence[int] = SMOL_PROMPT_IDS,
    answer_id: str = "chatcmpl-a3314b09b486737c",
    prompt_tokens_details: dict[str, Any] | None = None,
    completion_tokens_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming vLLM 0.32 chat completion with one choice.

    ``log_probs``: one value per sampled id, or one value for all of them; by default
    ``-0.25 * (k + 1)`` at position ``k``, so a misaligned id/log-prob pair shows.
    """
    ids = list(token_ids)
    if log_probs is None:
        lps = [-0.25 * (k + 1) for k in range(len(ids))]
    elif isinstance(log_probs, int | float):
        lps = [float(log_probs)] * len(ids)
    else:
        lps = list(log_probs)
    prompt = list(prompt_ids)
    return {
        "id": answer_id,
        "object": "chat.completion",
        "created": 1795940059,
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": tool_calls or [],
                    "reasoning": reasoning,
                },
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp, "bytes": [65], "top_logprobs": []}
                        for t, lp in zip(ids, lps, strict=True)
                    ]
                },
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": ids,
                "routed_experts": None,
            }
        ],
        "system_fingerprint": "vllm-0.32.0-898fdafa",
        "usage": {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": prompt_tokens_details,
            "completion_tokens_details": completion_tokens_details,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": prompt,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
