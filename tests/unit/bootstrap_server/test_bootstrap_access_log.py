"""Which answers get an access line, the line's shape (uvicorn's formatter), slow warnings."""

from __future__ import annotations

import logging

import pytest
from uvicorn.logging import AccessFormatter

from kvhandoff.bootstrap_server.access_log import (
    ACCESS_FORMAT,
    AccessPolicy,
    RouteAccessFilter,
    is_route,
)
from kvhandoff.settings import Settings

LOOKUP = "/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=1&target_pp_rank=0"


def access_record(method: str, target: str, status: int) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, ACCESS_FORMAT,
                             ("127.0.0.1:5000", method, target, "1.1", status), None)


def test_the_access_line_is_what_uvicorns_formatter_unpacks() -> None:
    fmt = AccessFormatter('%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s',
                          use_colors=False)
    line = fmt.format(access_record("GET", LOOKUP, 200))
    assert line == f'INFO:     127.0.0.1:5000 - "GET {LOOKUP} HTTP/1.1" 200 OK'


@pytest.mark.parametrize(("target", "route"), [
    ("/route", True), (LOOKUP, True), ("/routes", False), ("/v1/route?x=1", False),
    ("/route/x", False)])
def test_is_route(target: str, route: bool) -> None:
    assert is_route(target) is route


def test_defaults_keep_only_route_errors_and_other_requests() -> None:
    policy = AccessPolicy.from_settings(Settings())
    assert (policy.route_access_log, policy.slow_request_s) == (False, 1.0)
    assert not policy.logs("GET", LOOKUP, 200)
    assert not policy.logs("GET", "/route", 304)
    for status in (400, 404, 503):
        assert policy.logs("GET", LOOKUP, status)
    assert policy.logs("PUT", "/route", 200)  # a registration
    assert policy.logs("GET", "/health", 200)
    assert policy.logs("GET", "/v1/route?engine_id=p&dp_rank=0", 200)
    every = AccessPolicy(route_access_log=True)
    assert every.logs("GET", LOOKUP, 200) and every.logs_route(200)


def test_filter_drops_quiet_lines_and_never_hides_an_unknown_shape() -> None:
    f = RouteAccessFilter(AccessPolicy())
    assert not f.filter(access_record("GET", LOOKUP, 200))
    assert f.filter(access_record("GET", LOOKUP, 503))
    assert f.filter(access_record("PUT", "/route", 200))
    odd = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "%s", ("x",), None)
    assert f.filter(odd)
    bad_status = access_record("GET", LOOKUP, 200)
    bad_status.args = ("c", "GET", LOOKUP, "1.1", "not-a-status")
    assert f.filter(bad_status)


def test_slow_requests_are_warned_with_their_duration(caplog: pytest.LogCaptureFixture) -> None:
    policy = AccessPolicy(slow_request_s=0.5)
    with caplog.at_level(logging.WARNING, logger="kvhandoff.bootstrap_server"):
        policy.check_slow("GET", LOOKUP, 200, 0.499)
        assert not caplog.records
        policy.check_slow("GET", LOOKUP, 200, 0.75)
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    assert rec.getMessage() == (f"slow request: GET {LOOKUP} answered 200 after 0.750 s "
                                f"(slow_request_s=0.5)")
