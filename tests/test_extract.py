"""The upstream contract: the request the proxy sends (capture fields, n, overrides) and
reading token ids and log-probs back from the answer (precedence and cross-checks).

Answers are vLLM 0.32's exact JSON (wire-formats §1.2, §1.4) with real SmolLM2 token ids.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from api.dialects import (
    Dialect,
    InvalidRequest,
    UnsupportedRequest,
    build_chat_upstream,
    build_completions_upstream,
)
from api.extract import (
    MalformedTokenPayload,
    MissingTokenIds,
    TokenExtractionError,
    _plain_token_ids,
    extract_chat_tokens,
    extract_completion_tokens,
    strip_chat_response,
    strip_completion_response,
    tokenize_request_body,
    with_tokenized_prompt,
)
from tests.support.vllm import vllm_chat_answer

# SmolLM2 chat template, user "Say hi in three words.", generation prompt (wire-formats §5.2).
PROMPT_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    36218,
    15876,
    281,
    1296,
    1924,
    30,
    2,
    198,
    1,
    520,
    9531,
    198,
]
GENERATION_IDS = [49, 103, 14143, 17, 339, 5248, 18948, 346]
LOG_PROBS = [-3.0727, -1.2486, -0.0312, -0.5, -0.25, -0.125, -9999.0, -0.0]


def vllm_chat(**overrides: Any) -> dict[str, Any]:
    """The §1.2 answer: inline ids + token_id log-probs, finish_reason length."""
    answer = vllm_chat_answer(
        "Awesome! I'm glad you",
        GENERATION_IDS,
        log_probs=LOG_PROBS,
        finish_reason="length",
        prompt_ids=PROMPT_IDS,
    )
    answer.update(overrides)
    return answer


def vllm_completion() -> dict[str, Any]:
    """The §1.4 completions answer."""
    return {
        "id": "cmpl-82fd",
        "object": "text_completion",
        "created": 1795940059,
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "text": "Hello.",
                "logprobs": {
                    "text_offset": [0, 14, 25],
                    "token_logprobs": [-2.19, -1.53, -0.35],
                    "tokens": ["token_id:19556", "token_id:30", "token_id:2"],
                    "top_logprobs": [
                        {"token_id:19556": -2.19},
                        {"token_id:30": -1.53},
                        {"token_id:2": -0.35},
                    ],
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [19556, 30, 2],
                "prompt_logprobs": None,
                "prompt_token_ids": [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


def choice(answer: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = answer["choices"][0]
    return result


# --------------------------------------------------------------------------- upstream request


def test_chat_upstream_adds_capture_fields_drops_streaming_and_remembers_it() -> None:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hi in three words."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
        "max_tokens": 8,
    }
    original = copy.deepcopy(body)
    upstream = build_chat_upstream(body, sampling_overrides={"temperature": 1.0, "top_k": -1})
    assert body == original
    assert upstream.body == {
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hi in three words."}],
        "temperature": 1.0,
        "top_k": -1,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "include_reasoning": True,
    }
    assert (upstream.path, upstream.dialect) == ("/v1/chat/completions", Dialect.CHAT)
    assert (upstream.stream, upstream.include_usage, upstream.keep_logprobs) == (True, True, False)


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage"),
    [
        ({}, False, False),
        ({"stream": False, "stream_options": {"include_usage": True}}, False, False),
        ({"stream": "true"}, False, False),
        ({"stream": True}, True, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, True, False),
    ],
)
def test_only_a_boolean_true_streams(
    fields: dict[str, Any], stream: bool, include_usage: bool
) -> None:
    upstream = build_chat_upstream({"model": "m", "messages": [], **fields})
    assert (upstream.stream, upstream.include_usage) == (stream, include_usage)
    assert "stream" not in upstream.body and "stream_options" not in upstream.body


def test_overrides_win_over_capture_fields_and_the_harness() -> None:
    upstream = build_chat_upstream(
        {"model": "m", "messages": [], "include_reasoning": False, "top_p": 0.5},
        sampling_overrides={"top_p": 1.0, "seed": 7},
    )
    assert (
        upstream.body["include_reasoning"] is True
    )  # capture needs it, harness cannot turn it off
    assert (upstream.body["top_p"], upstream.body["seed"]) == (1.0, 7)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_several_sequences_are_refused_with_the_reason(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedRequest) as caught:
        build_chat_upstream({"model": "m", "messages": [], **fields})
    assert caught.value.param == param
    if param != "use_beam_search":
        assert "exactly one sampled sequence" in caught.value.message


def test_n_one_passes_and_messages_are_required() -> None:
    assert build_chat_upstream({"model": "m", "messages": [], "n": 1}).body["n"] == 1
    with pytest.raises(InvalidRequest, match="messages"):
        build_chat_upstream({"model": "m"})


@pytest.mark.parametrize(
    ("fields", "top_logprobs", "keep"),
    [
        ({"logprobs": True, "top_logprobs": 5}, 5, True),
        ({"logprobs": True}, 0, True),
        ({"logprobs": True, "top_logprobs": -1}, 0, True),
        ({"logprobs": True, "top_logprobs": 500}, 0, True),
        ({"logprobs": False, "top_logprobs": 5}, 0, False),
    ],
)
def test_harness_logprobs_are_honoured_within_limits(
    fields: dict[str, Any], top_logprobs: int, keep: bool
) -> None:
    upstream = build_chat_upstream({"model": "m", "messages": [], **fields})
    assert upstream.body["logprobs"] is True
    assert upstream.body["top_logprobs"] == top_logprobs
    assert upstream.keep_logprobs is keep


def test_completions_upstream_fields() -> None:
    upstream = build_completions_upstream(
        {
            "model": "smol",
            "prompt": "Hello",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert upstream.body == {
        "model": "smol",
        "prompt": "Hello",
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    assert (upstream.path, upstream.dialect) == ("/v1/completions", Dialect.COMPLETIONS)
    assert (upstream.stream, upstream.include_usage, upstream.keep_logprobs) == (True, True, False)
    kept = build_completions_upstream({"model": "m", "prompt": [1, 2, 3], "logprobs": 2})
    assert (kept.body["logprobs"], kept.keep_logprobs) == (2, True)
    pinned = build_completions_upstream(
        {"model": "m", "prompt": "x"}, sampling_overrides={"logprobs": 1}
    )
    assert pinned.body["logprobs"] == 1


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
def test_completions_batch_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(UnsupportedRequest, match="exactly one prompt"):
        build_completions_upstream({"model": "m", "prompt": prompt})
    build_completions_upstream({"model": "m", "prompt": [prompt[0]]})  # a batch of one is fine


# --------------------------------------------------------------------------- extraction


def test_chat_inline_ids_are_read_and_cross_checked() -> None:
    payload = extract_chat_tokens(vllm_chat())
    assert payload.prompt_token_ids == PROMPT_IDS
    assert payload.generation_token_ids == GENERATION_IDS
    assert payload.generation_log_probs == LOG_PROBS
    assert (payload.prompt_source, payload.generation_source) == ("inline", "inline")
    assert not payload.needs_tokenize


def _outcome(answer: dict[str, Any], **kw: Any) -> Any:
    try:
        return extract_chat_tokens(answer, **kw)
    except TokenExtractionError as exc:
        return (type(exc), str(exc))


bad_ids = st.sampled_from([-1, 2**31, True, 1.5, "7", None])


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20),
    st.lists(st.integers(0, 2**31 - 1), max_size=20),
    st.none() | st.tuples(st.integers(0, 20), bad_ids),
    st.integers(0, 20),
    st.booleans(),
)
def test_a_prompt_checked_up_to_its_known_prefix_reads_as_one_checked_whole(
    known: list[int], new: list[int], bad: tuple[int, Any] | None, checked: int, beyond: bool
) -> None:
    """A prompt whose leading ids the proxy took from the last (already checked) prompt: only
    the rest is checked, and the outcome is the full check's, to the wording of a refusal
    (a bad id's position counts in the whole prompt).  The count never exceeds the known
    prefix (the caller's promise); one beyond the whole list has it checked whole."""
    suffix = list(new)
    if bad is not None:
        suffix.insert(min(bad[0], len(suffix)), bad[1])
    prompt = [*known, *suffix]
    checked = len(prompt) + 1 + checked if beyond else min(checked, len(known))
    answer = vllm_chat(prompt_token_ids=prompt)
    answer["usage"] = {**answer["usage"], "prompt_tokens": len(prompt)}
    full = _outcome(copy.deepcopy(answer))
    assert _outcome(answer, checked_prompt=checked) == full
    assert isinstance(full, tuple) == (bad is not None)


def test_a_known_prefix_prompt_is_taken_as_it_is() -> None:
    answer = vllm_chat()
    same = extract_chat_tokens(answer, checked_prompt=5).prompt_token_ids
    assert same is answer["prompt_token_ids"]  # built for this answer by the cache: no copy
    assert extract_chat_tokens(answer).prompt_token_ids is not answer["prompt_token_ids"]
    bad = vllm_chat(prompt_token_ids=[*PROMPT_IDS[:5], -3, *PROMPT_IDS[5:]])
    with pytest.raises(MalformedTokenPayload, match=r"prompt_token_ids\[5\] is -3"):
        extract_chat_tokens(bad, checked_prompt=5)


def test_completions_inline_ids_are_on_the_choice() -> None:
    payload = extract_completion_tokens(vllm_completion())
    assert payload.prompt_token_ids == [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]
    assert payload.generation_token_ids == [19556, 30, 2]
    assert payload.generation_log_probs == [-2.19, -1.53, -0.35]


def test_without_return_token_ids_generation_comes_from_logprobs_and_prompt_needs_tokenize() -> (
    None
):
    answer = vllm_chat(prompt_token_ids=None)
    del choice(answer)["token_ids"]
    payload = extract_chat_tokens(answer)
    assert payload.needs_tokenize
    assert (payload.prompt_source, payload.generation_source) == ("tokenize", "logprobs")
    assert payload.generation_token_ids == GENERATION_IDS
    assert payload.generation_log_probs == LOG_PROBS

    tokenized = {"count": 36, "max_model_len": 2048, "tokens": PROMPT_IDS, "token_strs": None}
    completed = with_tokenized_prompt(payload, tokenized, usage=answer["usage"])
    assert completed.prompt_token_ids == PROMPT_IDS
    assert completed.prompt_source == "tokenize"

    with pytest.raises(MalformedTokenPayload, match=r"usage\.prompt_tokens=36 but 35"):
        with_tokenized_prompt(payload, {"tokens": PROMPT_IDS[1:]}, usage=answer["usage"])
    with pytest.raises(MalformedTokenPayload, match="count=37"):
        with_tokenized_prompt(payload, {"count": 37, "tokens": PROMPT_IDS})
    with pytest.raises(MalformedTokenPayload, match="no `tokens`"):
        with_tokenized_prompt(payload, {"count": 36})


def test_completions_without_inline_ids_use_logprob_tokens() -> None:
    answer = vllm_completion()
    del choice(answer)["token_ids"], choice(answer)["prompt_token_ids"]
    payload = extract_completion_tokens(answer)
    assert payload.needs_tokenize
    assert payload.generation_token_ids == [19556, 30, 2]


def test_message_level_bundle_wins_and_must_agree_with_inline_ids() -> None:
    answer = vllm_chat()
    message = choice(answer)["message"]
    message.update(
        prompt_token_ids=list(PROMPT_IDS),
        generation_token_ids=list(GENERATION_IDS),
        generation_log_probs=list(LOG_PROBS),
        routed_experts="base64-npy",
    )
    payload = extract_chat_tokens(answer)
    assert payload.prompt_source == "message_bundle"
    assert payload.routed_experts == "base64-npy"

    message["generation_token_ids"] = [*GENERATION_IDS[:-1], 2]
    with pytest.raises(MalformedTokenPayload, match="bundle disagrees with inline"):
        extract_chat_tokens(answer)


def test_bundle_alone_is_enough() -> None:
    answer = vllm_chat(prompt_token_ids=None)
    del choice(answer)["token_ids"], choice(answer)["logprobs"]
    choice(answer)["message"].update(
        prompt_token_ids=PROMPT_IDS,
        generation_token_ids=GENERATION_IDS,
        generation_log_probs=LOG_PROBS,
    )
    assert extract_chat_tokens(answer).generation_log_probs == LOG_PROBS


@pytest.mark.parametrize(
    ("mutate", "detail"),
    [
        (
            lambda a: choice(a)["message"].update(prompt_token_ids=PROMPT_IDS),
            "partial message-level token bundle",
        ),
        (
            lambda a: choice(a)["message"].update(
                prompt_token_ids=PROMPT_IDS,
                generation_token_ids=GENERATION_IDS,
                generation_log_probs=LOG_PROBS[:-1],
            ),
            "8 generation ids but 7 log-probs",
        ),
        (lambda a: choice(a).update(token_ids=None), "partial token metadata; missing: token_ids"),
        (
            lambda a: a.update(prompt_token_ids=None),
            "partial token metadata; missing: prompt_token_ids",
        ),
        (
            lambda a: choice(a).update(token_ids=[*GENERATION_IDS[:3], 7, *GENERATION_IDS[4:]]),
            "position 3: 7 != 17",
        ),
        (
            lambda a: choice(a).update(token_ids=GENERATION_IDS[:-1]),
            "7 generated token ids but 8 log-probs",
        ),
        (
            lambda a: choice(a).update(logprobs=None),
            "8 generated token ids but the answer has no log-probs",
        ),
        (lambda a: a["usage"].update(prompt_tokens=35), "usage.prompt_tokens=35 but 36"),
        (lambda a: a["usage"].update(completion_tokens=9), "usage.completion_tokens=9 but 8"),
        (lambda a: a.update(choices=[choice(a), choice(a)]), "exactly one choice, got 2"),
        (lambda a: a.update(choices=None), "exactly one choice"),
        (lambda a: choice(a)["token_ids"].__setitem__(0, -1), r"token_ids\[0\] is -1"),
        (lambda a: choice(a)["token_ids"].__setitem__(0, True), r"token_ids\[0\] is True"),
        (lambda a: a.update(prompt_token_ids="1 2 3"), "prompt_token_ids is not a list"),
        (
            lambda a: choice(a)["logprobs"]["content"][2].update(token="!"),
            "log-prob token 2 is '!'",
        ),
        (
            lambda a: choice(a)["logprobs"]["content"][1].update(logprob=None),
            r"\[1\] is None, not a number",
        ),
        (lambda a: choice(a)["logprobs"]["content"][1].update(logprob="-1.0"), "not a number"),
        (lambda a: choice(a)["logprobs"]["content"][1].update(logprob=True), "not a number"),
        (
            lambda a: choice(a)["logprobs"]["content"][1].update(logprob=math.nan),
            "nan, not a log-probability",
        ),
        (
            lambda a: choice(a)["logprobs"]["content"][1].update(logprob=math.inf),
            "inf, not a log-probability",
        ),
        (lambda a: choice(a).update(logprobs=[1, 2]), "logprobs is not an object"),
    ],
)
def test_disagreement_and_partial_metadata_are_malformed(mutate: Any, detail: str) -> None:
    answer = vllm_chat()
    mutate(answer)
    with pytest.raises(MalformedTokenPayload, match=detail) as caught:
        extract_chat_tokens(answer)
    assert caught.value.reason == "malformed_token_payload"
    assert caught.value.reason_detail == str(caught.value)


def test_negative_infinity_and_the_clamp_value_are_valid_log_probs() -> None:
    wire = json.dumps(vllm_chat()).replace('"logprob": -0.0,', '"logprob": -Infinity,')
    payload = extract_chat_tokens(json.loads(wire))
    assert payload.generation_log_probs[-1] == -math.inf
    assert payload.generation_log_probs[-2] == -9999.0


def test_no_token_information_at_all_is_missing_token_ids() -> None:
    answer = vllm_chat(prompt_token_ids=None)
    choice(answer).update(token_ids=None, logprobs=None)
    with pytest.raises(MissingTokenIds) as caught:
        extract_chat_tokens(answer)
    assert caught.value.reason == "missing_token_ids"
    assert "return_token_ids" in caught.value.reason_detail
    assert isinstance(caught.value, TokenExtractionError)


def test_text_logprob_tokens_without_inline_ids_are_missing_ids_but_fine_beside_them() -> None:
    answer = vllm_chat(prompt_token_ids=None)
    choice(answer)["token_ids"] = None
    for entry in choice(answer)["logprobs"]["content"]:
        entry["token"] = "A"
    with pytest.raises(MissingTokenIds, match="text, not token_id:N"):
        extract_chat_tokens(answer)

    with_inline = vllm_chat()  # e.g. SGLang: text tokens, inline ids
    for entry in choice(with_inline)["logprobs"]["content"]:
        entry["token"] = "A"
    assert extract_chat_tokens(with_inline).generation_token_ids == GENERATION_IDS


def test_empty_generation_is_valid() -> None:
    answer = vllm_chat(usage={"prompt_tokens": 36, "completion_tokens": 0, "total_tokens": 36})
    choice(answer).update(token_ids=[], logprobs={"content": []})
    assert extract_chat_tokens(answer).generation_token_ids == []
    choice(answer)["logprobs"] = None
    assert extract_chat_tokens(answer).generation_log_probs == []


def test_completions_logprob_lists_must_line_up() -> None:
    answer = vllm_completion()
    choice(answer)["logprobs"]["token_logprobs"] = [-2.19, -1.53]
    with pytest.raises(MalformedTokenPayload, match="do not line up"):
        extract_completion_tokens(answer)


def test_tokenize_request_body_keeps_only_prompt_affecting_fields() -> None:
    upstream = build_chat_upstream(
        {
            "model": "smol",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "chat_template_kwargs": {"enable_thinking": False},
            "temperature": 0.5,
        }
    ).body
    assert tokenize_request_body(upstream) == {
        "model": "smol",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    completions = build_completions_upstream({"model": "smol", "prompt": "Hi", "max_tokens": 3})
    assert tokenize_request_body(completions.body) == {"model": "smol", "prompt": "Hi"}


# --------------------------------------------------------------------------- stripping


def test_chat_answer_is_stripped_for_the_harness_and_wrapped_for_the_record() -> None:
    answer = vllm_chat()
    choice(answer)["message"]["generation_log_probs"] = LOG_PROBS  # a bundle too
    original = copy.deepcopy(answer)
    stripped = strip_chat_response(answer)
    assert answer == original

    body = stripped.harness_body
    text = json.dumps(body)
    for marker in ("prompt_token_ids", "token_ids", "token_id:", "generation_log_probs"):
        assert marker not in text
    assert "logprobs" not in choice(body) and "routed_experts" not in choice(body)
    assert choice(body)["message"]["content"] == "Awesome! I'm glad you"
    assert body["usage"] == original["usage"] and body["id"] == original["id"]
    ChatCompletion.model_validate(body)

    assert stripped.output_items == [
        {
            "role": "assistant",
            "content": "Awesome! I'm glad you",
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": None,
            "type": "message",
        }
    ]
    assert (stripped.response_id, stripped.token_item_index) == ("chatcmpl-a3314b09b486737c", 0)


def test_harness_logprobs_survive_stripping_when_asked() -> None:
    stripped = strip_chat_response(vllm_chat(), keep_logprobs=True)
    assert choice(stripped.harness_body)["logprobs"] == choice(vllm_chat())["logprobs"]
    assert "token_ids" not in choice(stripped.harness_body)


@pytest.mark.parametrize("keep_logprobs", [False, True])
def test_the_stripped_copies_share_nothing_with_the_answer(keep_logprobs: bool) -> None:
    """The harness body and the record's items are copies: changing either (the harness
    answer is rewritten per dialect) changes neither the answer extraction reads nor the
    other, and a log-prob of -inf (which orjson alone would copy as null) stays -inf."""
    answer = vllm_chat()
    choice(answer)["logprobs"]["content"][0]["logprob"] = -math.inf
    original = copy.deepcopy(answer)
    stripped = strip_chat_response(answer, keep_logprobs=keep_logprobs)
    items_before = copy.deepcopy(stripped.output_items)
    body = stripped.harness_body
    choice(body)["message"]["content"] = "changed"
    body["usage"]["prompt_tokens"] = -1
    if keep_logprobs:
        assert choice(body)["logprobs"]["content"][0]["logprob"] == -math.inf
        choice(body)["logprobs"]["content"][0]["logprob"] = 0.0
    stripped.output_items[0]["content"] = "also changed"
    assert answer == original
    assert items_before[0]["content"] == choice(original)["message"]["content"]


def test_completion_answer_is_stripped() -> None:
    stripped = strip_completion_response(vllm_completion())
    text = json.dumps(stripped.harness_body)
    assert "token_ids" not in text and "token_id:" not in text
    Completion.model_validate(stripped.harness_body)
    assert stripped.output_items == [{"type": "message", "role": "assistant", "content": "Hello."}]
    assert stripped.response_id == "cmpl-82fd"


@pytest.mark.parametrize(
    "junk", [{}, {"choices": "x"}, {"choices": [None]}, {"id": 3, "choices": []}]
)
def test_stripping_never_raises_so_the_harness_is_always_answered(junk: dict[str, Any]) -> None:
    for strip in (strip_chat_response, strip_completion_response):
        stripped = strip(junk)
        assert stripped.output_items == []
        assert stripped.token_item_index is None
        assert stripped.response_id is None


@pytest.mark.parametrize("module_name", ["api.dialects", "api.extract", "ledger.fingerprint"])
def test_public_names_are_exactly_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__)
    assert all(hasattr(module, name) for name in exported)
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and getattr(value, "__module__", module_name).startswith(module_name)
        and callable(value)
    }
    assert public <= exported


_TOKEN_TEXT = st.one_of(
    st.integers(min_value=0, max_value=2**40).map(lambda n: f"token_id:{n}"),
    st.sampled_from(
        [
            "token_id:",
            "token_id:+1",
            "token_id: 1",
            "token_id:007",
            "token_id:\u0661",
            "token_id:1token_id:2",
            "token_id:1\x00token_id:2",
            "x",
            "",
            "Token_id:1",
            "\x00",
        ]
    ),
    st.text(max_size=12),
)


@settings(deadline=None)
@given(st.lists(_TOKEN_TEXT, max_size=12))
def test_token_id_texts_parsed_at_once_match_one_regex_match_per_token(tokens: list[str]) -> None:
    """The all-at-once parse of ``token_id:N`` log-prob tokens gives exactly what a strict
    per-token match gives (``token_id:`` then ASCII digits), and declines everything else."""
    import re

    strict = [re.fullmatch(r"token_id:([0-9]+)", t) for t in tokens]
    expected = [int(m.group(1)) for m in strict if m] if tokens and all(strict) else None
    assert _plain_token_ids(tokens) == expected
