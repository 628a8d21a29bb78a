"""The control state's records: every kind round-trips, and anything but a whole, valid record
of this schema under its own key is refused (never acted on); fitted models carry their
timings between processes, each timing once."""

from __future__ import annotations

import json

import pytest

from conductor.control_records import (
    SCHEMA,
    InstanceControl,
    ModelControl,
    PolicyControl,
    RecordError,
    SloControl,
    TenantControl,
    decode,
    encode,
)
from conductor.scheduler.prefill_model import PrefillTimeFitter, PrefillTimeModel
from conductor.tenants import Limits

RECORDS = [
    InstanceControl("decode-1", draining=True),
    InstanceControl("both-0", role="prefill"),
    SloControl(2.0, 0.1),
    PolicyControl("least_loaded", "always"),
    TenantControl("acme", Limits(max_concurrency=8, tokens_per_s=2e4, priority="batch")),
    TenantControl("*", None),
    TenantControl("", Limits(may_loosen_slo=True)),
    ModelControl("prefill", "tiny", 1.7e9 + 2, (0.02, 2e-4, 1e-8),
                 (((1.0, 1000.0, 5e5), 0.31, 1.7e9), ((1.0, 10.0, 50.0), 0.02, 1.7e9 + 1))),
    ModelControl("tbt", "tiny", 1.7e9, (0.01, 1e-3, 1e-7), ()),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.key)
def test_every_record_round_trips_under_its_key(record) -> None:
    raw = encode(record)
    assert json.loads(raw)["schema"] == SCHEMA
    assert decode(record.key, raw) == record


def _edit(record, **changes) -> bytes:
    doc = json.loads(encode(record))
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("key", "value", "why"), [
    ("slo", encode(SloControl(2.0, 0.1))[:-7], "not JSON"),  # half-written
    ("slo", b"", "not JSON"),
    ("slo", b"[1, 2]", "not a JSON object"),
    ("slo", _edit(SloControl(2.0, 0.1), schema=SCHEMA + 1), "schema"),
    ("slo", _edit(SloControl(2.0, 0.1), schema=None), "schema"),
    ("slo", _edit(SloControl(2.0, 0.1), ttft_slo_s=0), "ttft_slo_s"),
    ("slo", _edit(SloControl(2.0, 0.1), ttft_slo_s="2"), "ttft_slo_s"),
    ("slo", _edit(SloControl(2.0, 0.1), ttft_slo_s=True), "ttft_slo_s"),
    ("slo", b'{"schema": 1, "kind": "slo", "ttft_slo_s": NaN, "tbt_slo_s": 1}', "ttft_slo_s"),
    ("slo", _edit(SloControl(2.0, 0.1), extra=1), "fields"),
    ("slo", encode(PolicyControl("kv_centric", "auto")), "stored under"),
    ("policy", _edit(PolicyControl("kv_centric", "auto"), policy="fastest"), "policy"),
    ("instances/decode-2", encode(InstanceControl("decode-1", True)), "stored under"),
    ("instances/decode-1", _edit(InstanceControl("decode-1", True), draining="yes"),
     "draining"),
    ("instances/decode-1", _edit(InstanceControl("decode-1", True), role="leader"), "role"),
    ("instances/a b", encode(InstanceControl("decode-1")).replace(b"decode-1", b"a b"),
     "instance id"),
    ("tenants/acme", _edit(TenantControl("acme", Limits()), limits={"max_concurrency": -1,
                                                                   "tokens_per_s": 0,
                                                                   "priority": "batch",
                                                                   "may_loosen_slo": False}),
     "max_concurrency"),
    ("tenants/acme", _edit(TenantControl("acme", Limits()), limits={"priority": "batch"}),
     "fields"),
    ("models/prefill", _edit(RECORDS[7], coefficients=[0.1, -1, 0]), "coefficients"),
    ("models/prefill", _edit(RECORDS[7], rows=[[1, 2, 3, 0, 1e9]]), "row"),
    ("models/prefill", _edit(RECORDS[7], rows=[[1, 2, 1e9]]), "row"),
    ("models/gpu", _edit(RECORDS[7], fitted="gpu"), "fitted"),
    ("models/prefill", _edit(RECORDS[7], served_model=""), "served_model"),
    ("models/prefill", _edit(RECORDS[7], fitted_at=None), "fitted_at"),
    ("weather", b'{"schema": 1, "kind": "weather"}', "unknown kind"),
])
def test_anything_but_a_whole_valid_record_under_its_key_is_refused(key, value, why) -> None:
    with pytest.raises(RecordError, match=why):
        decode(key, value)


def test_a_default_instance_record_is_stored_as_none() -> None:
    assert InstanceControl("decode-0").default
    assert not InstanceControl("decode-0", draining=True).default
    assert not InstanceControl("both-0", role="decode").default


def test_a_fitter_adopts_another_ones_model_exactly_and_each_timing_once() -> None:
    a, b = PrefillTimeFitter(), PrefillTimeFitter()
    for n in (600, 1200, 2400, 3000, 4000):
        a.observe(n, 0, n * 4e-4, now=100.0)
    assert a.model != a.prior
    assert b.adopt(a.model, a.rows(), now=5.0, wall_now=max(w for *_, w in a.rows()))
    assert b.model == a.model and b.rows() == a.rows()  # taken as fitted, from the same rows
    assert b.observations == 0  # none of them timed here: nothing of b's own to write
    assert not b.adopt(a.model, a.rows(), now=6.0, wall_now=0.0)  # nothing new: unchanged
    b.observe(5000, 0, 2.0, now=7.0)
    assert a.adopt(b.model, b.rows(), now=101.0, wall_now=max(w for *_, w in b.rows()))
    assert len(a.rows()) == 6 and set(a.rows()) == set(b.rows())  # each timing once


def test_adopted_rows_age_by_their_wall_clock_time() -> None:
    a = PrefillTimeFitter()
    for n in (600, 1200, 2400, 3000):
        a.observe(n, 0, n * 4e-4, now=0.0)
    fresh, old = PrefillTimeFitter(), PrefillTimeFitter()
    wall = max(w for *_, w in a.rows())
    fresh.adopt(PrefillTimeModel(), a.rows(), now=50.0, wall_now=wall)
    old.adopt(PrefillTimeModel(), a.rows(), now=50.0, wall_now=wall + 3600)  # an hour later
    fresh.refresh(60.0)
    old.refresh(60.0)
    slow = a.model.predict(3000, 0)
    assert abs(fresh.model.predict(3000, 0) - slow) < 0.05 * slow
    prior = PrefillTimeModel().predict(3000, 0)
    assert abs(old.model.predict(3000, 0) - prior) < 0.01 * prior  # back to the prior


def test_an_adopted_model_is_held_as_fitted_then_refitted_once_its_fit_is_old() -> None:
    a = PrefillTimeFitter()
    for n in (600, 1200, 2400, 3000):
        a.observe(n, 0, n * 4e-4, now=0.0)
    wall = max(w for *_, w in a.rows())
    recent, stale = PrefillTimeFitter(), PrefillTimeFitter()
    recent.adopt(a.model, a.rows(), now=10.0, wall_now=wall + 1, fitted_wall=wall)
    stale.adopt(a.model, a.rows(), now=10.0, wall_now=wall + 3600, fitted_wall=wall)
    assert recent.model == a.model and stale.model == a.model  # as the record says
    recent.refresh(11.0)
    stale.refresh(11.0)  # its first use refits it: an hour of ageing, back to the prior
    assert recent.model == a.model
    prior = PrefillTimeModel().predict(3000, 0)
    assert abs(stale.model.predict(3000, 0) - prior) < 0.01 * prior
