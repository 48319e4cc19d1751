"""bench/structured.py: its schema is the issue's (5 to 10 fields), its instance fits it, and the
report shows each variant's ratios to the unconstrained one."""

from __future__ import annotations

import json

import jsonschema

from bench.structured import INSTANCE_TEXT, SCHEMA, VARIANTS, StructuredCost, report


def test_the_schema_has_five_to_ten_fields_and_the_instance_fits_it() -> None:
    assert 5 <= len(SCHEMA["properties"]) <= 10
    jsonschema.validate(json.loads(INSTANCE_TEXT), SCHEMA)


def test_the_report_gives_each_variants_ratio_to_the_unconstrained_one() -> None:
    cost = StructuredCost(
        step_ms=dict(zip(VARIANTS, (100.0, 105.0, 120.0))), fastest_step_ms=dict(zip(VARIANTS, (30.0, 30.0, 33.0))),
        mask_work_ms=(1.5, 0.7), tokenizer_build_ms=300.0, first_compile_ms=2.0, cached_lookup_ms=0.001, token_mask_ms=0.1,
    )
    assert cost.ratio(VARIANTS[2]) == 1.2 and cost.fastest_ratio(VARIANTS[2]) == 1.1
    text = report(cost)
    assert "| c: all constrained | 120.0 | 1.200 | 33.0 | 1.100 |" in text
    assert "schema compile 2.00 ms" in text and "0.001 ms" in text
