"""The family table (`kha_hf/modeling/families.py`) against placements written out from transformers' own attention
code (`expected_layouts.py`), for every family's tiny config: same projections, same rows for each head's q/k/v part.
Broken rows (blocks swapped, a gate knocked instead of the query, MLA's segments reversed) must fail the check."""

from __future__ import annotations

import dataclasses

import pytest

from kha_hf.modeling import families as table
from tests.helpers import ALL_FAMILIES, tiny_config
from tests.modeling.expected_layouts import expected_rows, table_rows


def _check(model_type: str, layout, config) -> None:
    assert table_rows(layout, config) == expected_rows(model_type, config), model_type


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_table_places_the_knocks_where_the_family_code_slices_q_k_v(family):
    config = tiny_config(family)
    _check(config.model_type, table.family_spec(config.model_type).layout, config)


def _swap(blocks: tuple, i: int, j: int) -> tuple:
    blocks = list(blocks)
    blocks[i], blocks[j] = blocks[j], blocks[i]
    return tuple(blocks)


def _reversed_segments(blocks: tuple) -> tuple:
    return tuple(dataclasses.replace(b, segments=tuple(reversed(b.segments))) for b in blocks)


BROKEN = {
    "phi3 k and v blocks swapped": ("phi3", lambda lay: {"qkv_proj": _swap(lay["qkv_proj"], 1, 2)}),
    "qwen3_next gate knocked instead of the query": (
        "qwen3_next",
        lambda lay: {**lay, "q_proj": _reversed_segments(lay["q_proj"])},
    ),
    "deepseek_v3 kv_b_proj segments reversed": (
        "deepseek_v3",
        lambda lay: {**lay, "kv_b_proj": _reversed_segments(lay["kv_b_proj"])},
    ),
    "deepseek_v3 RoPE part of q knocked": (
        "deepseek_v3",
        lambda lay: {**lay, "q_b_proj": _reversed_segments(lay["q_b_proj"])},
    ),
    "llama k and v heads counts swapped": (
        "llama",
        lambda lay: {**lay, "k_proj": (dataclasses.replace(lay["k_proj"][0], heads=table.Q_HEADS),)},
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_row_fails_the_check(case):
    family, break_row = BROKEN[case]
    config = tiny_config(family)
    with pytest.raises(AssertionError):
        _check(config.model_type, break_row(table.FAMILIES[family].layout), config)
