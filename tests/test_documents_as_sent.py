"""Documents are stored as sent: an upload's analysis (and POST /apps' details) reach
PostgreSQL as the text the client sent, cast to jsonb once, so numbers stay exact (jsonb
keeps numeric: 1e-400 is not 0, a 30-digit decimal keeps its digits) and GET /apps
answers jsonb's rendering of the sent text. The checks on bad input still refuse with a
400 and write nothing: NUL, lone surrogates, nesting, and numbers PostgreSQL may not
store or would write out far longer than sent; whatever jsonb itself refuses is such a
400 too, never a 500."""

from __future__ import annotations

import dataclasses
import json
from itertools import count

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ADMIN_TOKEN, UPLOAD_PASSWORD

import handler
from helpers import call_api, connect, gateway_event, insert_app, table_digest

ANALYSER = {"authorization": f"Bearer {UPLOAD_PASSWORD}"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
PERSISTENT_DATABASE = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def jsonb_text(sql, text: str) -> str | None:
    """PostgreSQL's rendering of a JSON text as jsonb; None if jsonb refuses it."""
    try:
        ((rendered,),) = sql.run("SELECT CAST(CAST(:t AS jsonb) AS text)", t=text)
    except Exception as error:
        assert handler.sqlstate(error) is not None, error
        return None
    return rendered


def upload(appid: str, text: str) -> dict:
    """The text as API Gateway passes a JSON body on; one that is not Unicode text (a
    lone surrogate) as the bytes a client would send, base64-encoded as API Gateway does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        body, base64_body = text.encode("utf-8", "surrogatepass"), True
    else:
        body, base64_body = text, False
    return call_api(
        gateway_event(
            "POST",
            "/uploadAnalysis",
            f"appId={appid}&analysisVersion=4",
            headers={**ANALYSER, "content-type": "application/json"},
            body=body,
            base64_body=base64_body,
        )
    )


def shown_analysis(appid: str) -> str:
    """The body of the public GET /apps/{appId}."""
    answer = call_api(gateway_event("GET", f"/apps/{appid}"))
    assert answer["statusCode"] == 200, answer
    return answer["body"]


# --- exact numbers ----------------------------------------------------------------------

EXACT = [
    ("1e-400", "0." + "0" * 399 + "1"),
    ("123456789012345678901234567890", "123456789012345678901234567890"),
    ("0.123456789012345678901234567890", "0.123456789012345678901234567890"),
    ("12345678901234567890.1234567890", "12345678901234567890.1234567890"),
    ("5e-324", "0." + "0" * 323 + "5"),
    ("1e308", "1" + "0" * 308),
    ("1.50E+1", "15.0"),
    ("-0.0", "0.0"),
    ("100e-2", "1.00"),
]


@pytest.mark.parametrize(("sent", "written"), EXACT, ids=[sent for sent, _ in EXACT])
def test_numbers_come_back_exactly_as_jsonb_writes_them(database_url, sql, sent, written):
    insert_app(sql, "com.example.exact", status="processing")
    text = '{"success": true, "x": ' + sent + ', "list": [' + sent + "]}"
    answer = upload("com.example.exact", text)
    assert answer["statusCode"] == 200, answer
    assert sql.run("SELECT analysis->>'x' FROM apps") == [[written]]
    rendered = jsonb_text(sql, text)
    assert f'"x": {written}' in rendered
    assert f'"analysis":{rendered}' in shown_analysis("com.example.exact")
    assert sql.run("SELECT analysis->>'x' FROM app_analyses") == [[written]]  # the history


def test_details_are_stored_as_sent(database_url, sql):
    """POST /apps stores the body's `details` member as sent: its numbers exact, and a
    review count written 1E+3 is the popularity 1000 (app_popularity reads jsonb's text)."""
    body = '{"appId": "com.example.details", "details": {"reviews": 1E+3, "rating": 4.10}}'
    answer = call_api(
        gateway_event(
            "POST", "/apps", headers={**ADMIN, "content-type": "application/json"}, body=body
        )
    )
    assert answer["statusCode"] == 201, answer
    assert sql.run(
        "SELECT details->>'reviews', details->>'rating', app_popularity(details) FROM apps"
    ) == [["1000", "4.10", 1000]]
    assert json.loads(answer["body"])["details"] == {"reviews": 1000, "rating": 4.10}


# --- what jsonb writes for a number literal, counted ------------------------------------


@st.composite
def number_literals(draw, max_exponent: int = handler.MAX_NUMBER_EXPONENT) -> str:
    """A JSON number of any shape: sign, zero or digits, a fraction with leading and
    trailing zeros, an exponent in either case, signed or not, with leading zeros."""
    sign = draw(st.sampled_from(["", "-"]))
    integer = draw(st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,25}", fullmatch=True)))
    fraction = draw(st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,25}", fullmatch=True)))
    exponent = ""
    if draw(st.booleans()):
        value = draw(st.integers(0, max_exponent))
        zeros = "0" * draw(st.integers(0, 2))
        exponent = draw(st.sampled_from("eE")) + draw(st.sampled_from(["", "+", "-"]))
        exponent += zeros + str(value)
    return sign + integer + fraction + exponent


@pytest.mark.slow  # ~30 s
@settings(deadline=None, max_examples=300)
@given(literal=number_literals())
def test_the_written_out_form_of_a_number_is_what_postgresql_writes(server_url, literal):
    """written_number_length and written_number_text are PostgreSQL's own output for the
    literal (jsonb numeric), so the bound on a document's growth bounds what it writes."""
    sql = connect(server_url)
    try:
        ((written,),) = sql.run("SELECT CAST(:doc AS jsonb)->>0", doc=f"[{literal}]")
    finally:
        sql.close()
    assert handler.written_number_length(literal) == len(written)
    assert handler.written_number_text(literal) == written


# --- generated documents ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Literal:
    """A piece of JSON text written as is (a number literal of any shape)."""

    text: str


hostile_text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["\x00", "a\x00b", "\ud800", "\udfff x", "é", "💥", "\u2028", "\\", '"']),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**40), 10**40),
    number_literals().map(Literal),
    number_literals(max_exponent=1100).map(Literal),
    st.sampled_from(
        ["1e1000000", "0e99999999999999999999", "10e-16384", "1e-1001", "-0", "1" * 5000]
    ).map(Literal),
    hostile_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)
    ),
    max_leaves=16,
)


def render(value, ascii_only: bool, separator: str) -> str:
    """JSON text of value, with Literal parts as they are."""
    if isinstance(value, Literal):
        return value.text
    if isinstance(value, dict):
        items = (
            json.dumps(key, ensure_ascii=ascii_only) + ":" + render(item, ascii_only, separator)
            for key, item in value.items()
        )
        return "{" + separator.join(items) + "}"
    if isinstance(value, list):
        return "[" + separator.join(render(item, ascii_only, separator) for item in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def nested(depth: int, inner: str) -> str:
    return '{"a":' * depth + inner + "}" * depth


@st.composite
def analysis_texts(draw) -> str:
    ascii_only = draw(st.booleans())
    separator = draw(st.sampled_from([",", ", ", ",\n  "]))
    data = render(draw(json_values), ascii_only, separator)
    if draw(st.integers(0, 9)) == 0:
        data = nested(draw(st.integers(60, 66)), data)
    return '{"success": true, "data": ' + data + "}"


appids = count()


@settings(PERSISTENT_DATABASE, max_examples=150)
@given(text=analysis_texts())
def test_generated_documents_are_stored_as_sent_or_refused_with_a_400(database_url, sql, text):
    """Whatever JSON an analyser sends: stored, GET /apps answers jsonb's rendering of the
    very text sent (numbers of every shape exact); or refused with a 400 that names the
    check, with nothing written. Whatever jsonb refuses is such a 400, never a 500."""
    appid = f"com.example.sent{next(appids)}"
    insert_app(sql, appid, status="processing")
    before = table_digest(sql)
    answer = upload(appid, text)
    assert answer["statusCode"] in (200, 400), answer
    if answer["statusCode"] == 400:
        detail = json.loads(answer["body"])["detail"]
        assert "cannot be stored" not in detail, detail  # an input check, not the database
        assert table_digest(sql) == before
        return
    rendered = jsonb_text(sql, text)
    assert rendered is not None  # jsonb took what the service accepted
    assert sql.run("SELECT CAST(analysis AS text) FROM apps WHERE appid = :a", a=appid) == [
        [rendered]
    ]
    assert f'"analysis":{rendered}' in shown_analysis(appid)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"x": "a\\u0000b"}', "NUL"),
        ('{"k\\u0000": 1}', "NUL"),
        ('{"x": "\\ud800"}', "surrogate"),
        ('{"\\udfff": 1}', "surrogate"),
        (nested(65, "1"), "nests deeper"),
        ('{"x": 1e1000000}', "exponent beyond"),
        ('{"x": 0e99999999999999999999}', "exponent beyond"),
        ('{"x": 10e-16384}', "exponent beyond"),
        ('{"x": ' + "1" * 5000 + "}", "not valid JSON"),
        ('{"x": 1.' + "1" * 5000 + "}", "more than 4300 characters"),
        ('{"x": [' + ",".join(["1e-999"] * 80) + "]}", "bytes longer"),
        ('{"x": NaN}', "not valid JSON"),
    ],
    ids=lambda case: case[:40] if isinstance(case, str) else None,
)
def test_what_postgresql_cannot_store_is_a_400_that_names_it(database_url, sql, text, why):
    insert_app(sql, "com.example.bad", status="processing")
    before = table_digest(sql)
    answer = upload("com.example.bad", text)
    assert answer["statusCode"] == 400, answer
    assert why in json.loads(answer["body"])["detail"]
    assert table_digest(sql) == before


# --- parsed by PostgreSQL once ------------------------------------------------------------


@pytest.fixture
def statements_sent(monkeypatch):
    """Every statement the service's sessions run, with its parameters, in order."""
    sent: list[tuple[str, dict]] = []
    run = handler.Session._run

    def recording(session, sql, params):
        sent.append((sql, params))
        return run(session, sql, params)

    monkeypatch.setattr(handler.Session, "_run", recording)
    return sent


def parses_of(sent: list[tuple[str, dict]], document: str) -> int:
    """How often PostgreSQL parsed the document: each statement it went to, times the
    casts of it in that statement's text (a materialized CTE's one, however often the
    CTE is read)."""
    return sum(
        sql.count("CAST(:analysis AS jsonb)")
        for sql, params in sent
        if document in (params.get("analysis"), params.get("body"))
    )


def test_every_upload_parses_its_document_once(database_url, sql, statements_sent):
    """Each way a result goes (stored on a lease, stored over a failure, answered as
    stored already with and without a token, refused as a different result with and
    without a token): PostgreSQL parses the document once, never twice. A result
    refused before the document matters (an identity conflict) is not parsed at all."""
    one = '{"success": true, "n": 1.50}'
    two = '{"success": true, "n": 2}'
    insert_app(sql, "com.example.once", status="processing")

    def once(text: str, expected: int, token: str | None = None, parses: int = 1) -> None:
        statements_sent.clear()
        headers = {} if token is None else {handler.CLAIM_TOKEN_HEADER.lower(): token}
        answer = call_api(
            gateway_event(
                "POST",
                "/uploadAnalysis",
                "appId=com.example.once&analysisVersion=4",
                headers={**ANALYSER, "content-type": "application/json", **headers},
                body=text,
            )
        )
        assert answer["statusCode"] == expected, answer
        assert parses_of(statements_sent, text) == parses, statements_sent

    once(one, 200)  # the open lease's result: stored
    once(one, 200)  # the same again, no claim open: answered as stored already
    once(two, 409)  # another result, no claim open: refused
    sql.run(
        "UPDATE apps SET status = 'failed', failure_reason = 'analysis_failed',"
        " failure_retryable = true, analysis = '{\"success\": false}'"
    )
    once(two, 200)  # a success over a failure: told and stored in one statement
    once(two, 200)  # and then the same again
    sql.run("UPDATE apps SET status = 'queued'")
    claimed = call_api(gateway_event("GET", "/queue", "appId=com.example.once", headers=ANALYSER))
    token = claimed["headers"][handler.CLAIM_TOKEN_HEADER.lower()]
    once(one, 200, token)  # with the claim's token: stored
    once(one, 200, token)  # sent again with it: answered as the first time
    once(two, 409, token)  # another result with it: refused

    # POST /apps: its body (and so its details) is parsed once too.
    statements_sent.clear()
    body = '{"appId": "com.example.added", "details": {"reviews": "3", "x": 1e-5}}'
    added = call_api(
        gateway_event(
            "POST", "/apps", headers={**ADMIN, "content-type": "application/json"}, body=body
        )
    )
    assert added["statusCode"] == 201
    assert [sql for sql, params in statements_sent if body in params.values()] == [handler.ADD_APP]
    assert handler.ADD_APP.count("CAST(:body AS jsonb)") == 1


tokens = st.one_of(st.none(), st.sampled_from(["claim", "result", "other"]))


@given(
    status=st.sampled_from(["queued", "processing", "analysed", "failed"]),
    stored_version=st.one_of(st.none(), st.integers(1, 6)),
    has_result=st.booleans(),
    stored_success=st.booleans(),
    verified=st.booleans(),
    version=st.integers(1, 6),
    success=st.booleans(),
    token=tokens,
    same_claims=st.booleans(),
    refetch_requested=st.booleans(),
    current_version=st.integers(1, 6),
)
def test_being_the_stored_result_only_ever_makes_a_verdict_stored(
    status,
    stored_version,
    has_result,
    stored_success,
    verified,
    version,
    success,
    token,
    same_claims,
    refetch_requested,
    current_version,
):
    """What lets store_result parse a document once: for every row and result, the
    verdict when the result is the stored one is either the verdict when it is not, or
    "stored" (written nothing). So the document is compared only when that matters, and
    then in the statement that would store it."""
    claim, result_claim = handler.uuid.uuid4(), handler.uuid.uuid4()
    if same_claims:
        result_claim = claim
    given_token = {"claim": str(claim), "result": str(result_claim), "other": "x"}.get(token)
    target = handler.ResultTarget(
        status=status,
        version=stored_version,
        has_result=has_result,
        stored_success=stored_success,
        same_result=False,
        claim=claim if status == "processing" else None,
        result_claim=result_claim,
        result_verified=verified,
        refetch_requested=refetch_requested,
    )
    verdict = handler.judge_result(target, version, success, given_token, current_version)
    if_stored = handler.judge_result(
        dataclasses.replace(target, same_result=True),
        version,
        success,
        given_token,
        current_version,
    )
    assert if_stored == verdict or if_stored.action == "stored"
