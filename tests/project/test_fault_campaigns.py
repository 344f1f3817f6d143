"""A few cases of each campaign of ``tests/support/fault_campaigns.py`` (``make reliability`` runs them over many seeds:
``benchmarks/fault_campaigns.py``), so that the campaigns themselves keep working."""

from __future__ import annotations

from fault_campaigns import SITES
from fault_campaigns import cache_campaign
from fault_campaigns import cache_edits
from fault_campaigns import fsdp_campaign
from fault_campaigns import interrupt_campaign


def test_the_cache_campaign_serves_no_edited_workload(tmp_path):
    tally = cache_campaign(range(1), tmp_path)
    assert (tally.tried, tally.broke) == (1 + len(cache_edits()), 0), tally.broken


def test_the_interrupt_campaign_stops_every_search_whole():
    tally = interrupt_campaign(range(1))
    assert (tally.tried, tally.broke) == (len(SITES), 0), tally.broken


def test_the_fsdp_campaign_reaches_every_phase_of_a_step():
    tally, phases = fsdp_campaign(2, range(8))
    assert (tally.tried, tally.broke) == (8, 0), tally.broken
    assert phases == {"batch", "forward", "backward", "optimizer"}
