"""The lifecycle chaos run (issue #7 "Done when"): 2 P + 2 D real sidecars, mixed
layer families, random aborts, engine kills, sidecar kills and SIGSTOP pauses.
The long form is ``make chaos`` (10,000 requests)."""

from __future__ import annotations

import json

import pytest

from kvsidecar.sim import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.xfail(reason="KNOWN BUG found by this run (seed 11): at ~1,355 requests a P hold "
                          "(attention engine, both ranks) never ended; not fixed yet", strict=False)
def test_chaos_short_form(tmp_path) -> None:
    report = chaos.run(2000, tmp_path, seed=11)
    print(json.dumps(report.as_dict(), default=str))
    assert report.requests >= 2000
    assert chaos.problems(report) == []
    assert sum(report.outcomes.values()) + report.ended_by_sidecar_death >= 1
    assert report.outcomes["received"] > 0
