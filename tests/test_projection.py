"""Projection of a delivered chain (``ledger.projection``) and its contiguity check."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ledger.model import ChainLinkTokens
from ledger.projection import ProjectionError, assert_prefix_contiguous, project_chain

REASONING: dict[str, Any] = {
    "type": "reasoning",
    "summary": [{"type": "summary_text", "text": "look it up"}],
}
TOOL_CALL: dict[str, Any] = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
ANSWER: dict[str, Any] = {
    "type": "message",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "It is 18C in Paris."}],
}


def link(
    call_id: str,
    suffix: list[int],
    generation: list[int],
    items: list[dict[str, Any]] | None = None,
    index: int | None = None,
    routed_experts: Any = None,
) -> ChainLinkTokens:
    return ChainLinkTokens(
        model_call_id=call_id,
        prompt_suffix=suffix,
        generation_token_ids=generation,
        generation_log_probs=[-0.5 - i / 10 for i in range(len(generation))],
        output_items=[] if items is None else items,
        token_item_index=index,
        routed_experts=routed_experts,
    )


def three_calls() -> list[ChainLinkTokens]:
    """Prompts of length 3, 7 and 9 with generations of 2, 1 and 2 tokens."""
    return [
        link("c1", [1, 2, 3], [4, 5], [REASONING, TOOL_CALL], index=1),
        link("c2", [6, 7], [8], [ANSWER], index=0),
        link("c3", [9], [10, 11], [ANSWER], index=0),
    ]


def carriers(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if "generation_token_ids" in item]


def test_projection_shape_usage_and_contiguity() -> None:
    response = project_chain("3-0", three_calls(), "Qwen/Qwen3-4B")
    assert (response["id"], response["object"], response["model"]) == (
        "proj-3-0",
        "response",
        "Qwen/Qwen3-4B",
    )
    assert response["usage"] == {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}
    assert [item["prompt_token_ids"] for item in carriers(response)] == [
        [1, 2, 3],
        [1, 2, 3, 4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ]
    assert [item["generation_token_ids"] for item in carriers(response)] == [[4, 5], [8], [10, 11]]
    assert carriers(response)[0]["generation_log_probs"] == [-0.5, -0.6]
    assert_prefix_contiguous(response)


def test_text_and_tool_call_items_are_kept_and_only_the_carrier_has_tokens() -> None:
    response = project_chain("r", three_calls(), "m")
    output = response["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call", "message", "message"]
    assert output[0] == REASONING  # not the carrier: untouched, no token fields
    assert {k: v for k, v in output[1].items() if "token" not in k and "log" not in k} == TOOL_CALL
    assert output[3]["content"] == ANSWER["content"]


def test_token_item_index_chooses_the_carrier() -> None:
    items = [TOOL_CALL, ANSWER]
    first = project_chain("r", [link("c", [1], [2], items, index=0)], "m")["output"]
    assert "generation_token_ids" in first[0] and "generation_token_ids" not in first[1]


@pytest.mark.parametrize("index", [None, 2, -1, 99])
def test_invalid_or_missing_index_falls_back_to_the_last_item(index: int | None) -> None:
    output = project_chain("r", [link("c", [1], [2], [TOOL_CALL, ANSWER], index=index)], "m")[
        "output"
    ]
    assert "generation_token_ids" not in output[0]
    assert output[1]["generation_token_ids"] == [2]


def test_call_without_items_gets_a_token_only_carrier() -> None:
    response = project_chain("r", [link("c1", [1, 2], [3]), link("c2", [4], [5, 6])], "m")
    assert response["output"][0] == {
        "type": "message",
        "role": "assistant",
        "content": [],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    assert response["output"][1]["prompt_token_ids"] == [1, 2, 3, 4]
    assert_prefix_contiguous(response)


def test_routed_experts_only_when_captured() -> None:
    experts = [[[0, 3]], [[1, 2]]]
    response = project_chain(
        "r", [link("c1", [1], [2, 3], [ANSWER], 0, experts), link("c2", [4], [5], [ANSWER], 0)], "m"
    )
    assert response["output"][0]["routed_experts"] == experts
    assert "routed_experts" not in response["output"][1]


def test_callers_data_is_never_mutated_or_shared() -> None:
    links = three_calls()
    before = copy.deepcopy(links)
    response = project_chain("r", links, "m")
    assert links == before
    response["output"][3]["content"][0]["text"] = "changed"
    assert ANSWER["content"][0]["text"] == "It is 18C in Paris."
    prompts = [item["prompt_token_ids"] for item in carriers(response)]
    prompts[0].append(999)
    assert prompts[1][:4] == [1, 2, 3, 4]  # every carrier holds its own list
    response["output"][1]["generation_token_ids"].append(0)
    assert links[0].generation_token_ids == [4, 5]


def test_stale_token_fields_on_other_items_are_dropped() -> None:
    stale = dict(REASONING, generation_token_ids=[77], prompt_token_ids=[0])
    response = project_chain("r", [link("c1", [1], [2], [stale, ANSWER], index=1)], "m")
    assert response["output"][0] == REASONING
    assert_prefix_contiguous(response)


def test_projection_refuses_bad_links() -> None:
    with pytest.raises(ProjectionError, match="no safe trainable chain"):
        project_chain("r", [], "m")
    mismatched = ChainLinkTokens("c", [1], [2, 3], [-0.1], [], None)
    with pytest.raises(ProjectionError, match="2 generated tokens but 1 log-probs"):
        project_chain("r", [mismatched], "m")
    not_items: list[Any] = ["text"]
    with pytest.raises(ProjectionError, match="not an object"):
        project_chain("r", [link("c", [1], [2], not_items)], "m")
    assert issubclass(ProjectionError, ValueError)


def test_thousand_link_chain_projects_contiguously() -> None:
    links = [link(f"c{i}", [i, i + 1], [i + 2]) for i in range(1000)]
    response = project_chain("long", links, "m")
    assert response["usage"] == {"input_tokens": 2, "output_tokens": 1000, "total_tokens": 1002}
    assert len(response["output"][-1]["prompt_token_ids"]) == 2999
    assert_prefix_contiguous(response)


# ------------------------------------------------------------------------- contiguity check


def projected() -> dict[str, Any]:
    return project_chain("r", three_calls(), "m")


def test_contiguity_detects_a_changed_prompt_token() -> None:
    response = projected()
    carriers(response)[2]["prompt_token_ids"][4] = 0  # a generated token of c1 rewritten
    with pytest.raises(ProjectionError, match=r"not prefix-contiguous.*first difference at 4"):
        assert_prefix_contiguous(response)


def test_contiguity_detects_a_missing_generation() -> None:
    response = projected()
    carriers(response)[1]["prompt_token_ids"] = [1, 2, 3, 6, 7]  # c1's generation left out
    with pytest.raises(ProjectionError, match="not prefix-contiguous"):
        assert_prefix_contiguous(response)


def test_contiguity_detects_a_shorter_prompt() -> None:
    response = projected()
    carriers(response)[1]["prompt_token_ids"] = [1, 2, 3, 4]
    with pytest.raises(ProjectionError, match="not prefix-contiguous"):
        assert_prefix_contiguous(response)


def test_contiguity_detects_reordered_carriers() -> None:
    response = projected()
    response["output"] = response["output"][::-1]
    with pytest.raises(ProjectionError, match="not prefix-contiguous"):
        assert_prefix_contiguous(response)


def test_contiguity_requires_generated_tokens() -> None:
    with pytest.raises(ProjectionError, match="no trainable generated tokens"):
        assert_prefix_contiguous({"output": [ANSWER, TOOL_CALL]})
    empty = project_chain("r", [link("c", [1, 2], [])], "m")
    with pytest.raises(ProjectionError, match="no trainable generated tokens"):
        assert_prefix_contiguous(empty)


@pytest.mark.parametrize(
    "response",
    [
        {},
        {"output": "text"},
        {"output": [{"generation_token_ids": [1], "generation_log_probs": [0.0]}]},
        {"output": [{"prompt_token_ids": [1], "generation_token_ids": [2]}]},
        {
            "output": [
                {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": []}
            ]
        },
    ],
)
def test_contiguity_refuses_malformed_responses(response: dict[str, Any]) -> None:
    with pytest.raises(ProjectionError):
        assert_prefix_contiguous(response)
