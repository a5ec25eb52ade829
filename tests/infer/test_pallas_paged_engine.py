"""The engine decoding through ``paged_pallas`` gives the reference kernels' tokens.

``model.attention_impl = "pallas"`` pairs the Pallas flash kernel (prefill) with the Pallas
paged decode kernel (every decode step reads the pages: the accelerators' form, not
XLA:CPU's staged copy), both in interpret mode here. Greedy decoding of ragged prompts
must give exactly the tokens of the same weights under ``reference`` / ``paged_reference``.
"""

from __future__ import annotations

import dataclasses
import functools

from tiny_engines import greedy, make_engine, req, tiny_cfg

from jaxlab.infer import Engine, generate


@functools.cache
def engine(impl: str) -> Engine:
    """One layer, 2 kv heads for 4 query heads, 32 tokens in pages of 16; decode reads the
    pages every step, all rows (no row buckets)."""
    eng = make_engine(tiny_cfg(2, 32, [16, 32], 1, attention_impl=impl))
    eng.tuning = dataclasses.replace(eng.tuning, staged_pages=False, row_buckets=False)
    return eng


def test_greedy_decoding_through_paged_pallas_equals_the_reference() -> None:
    pallas, reference = engine("pallas"), engine("reference")
    assert (pallas.paged_kernel, reference.paged_kernel) == ("paged_pallas", "paged_reference")

    def requests(eng: Engine):
        prompts = [[3, 1, 4, 1, 5], [2] * 15, [7]]
        return [req(p, greedy(n), eng) for p, n in zip(prompts, (9, 12, 4), strict=True)]

    got = [r.token_ids for r in generate(pallas, requests(pallas))]
    want = [r.token_ids for r in generate(reference, requests(reference))]
    assert got == want
    assert [len(t) for t in got] == [9, 12, 4]
