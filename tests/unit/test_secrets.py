"""The secret scanner (both implementations) on every kind of the shared table, and the
secrets classifier on request items.

No secret-looking literal is committed: every example is generated here from a seeded random
source and assembled by concatenation.
"""

from __future__ import annotations

import base64
import json
import random
import re
import threading
from typing import Any

import msgspec
import pytest

from hotloop import _accel
from hotloop.pipeline import classifiers, classify
from hotloop.protocol.request import (
    FunctionCall,
    FunctionCallOutput,
    InputImage,
    InputText,
    ItemReference,
    Message,
    OtherItem,
    OutputText,
    decode_body,
    decode_item,
    validate,
)

PATTERNS = _accel.SECRET_PATTERNS
IMPLS = _accel.implementations()
SCANNERS = {name: impl["SecretScanner"](PATTERNS) for name, impl in IMPLS.items()}

_R = random.Random(20240611)
UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LOWER = UPPER.lower()
DIGITS = "0123456789"
ALNUM = UPPER + LOWER + DIGITS
TOKEN = ALNUM + "_-"
HEX = DIGITS + "abcdef"


def rnd(alphabet: str, n: int) -> str:
    return "".join(_R.choice(alphabet) for _ in range(n))


def b64url(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def pem(label: str, lines: int = 6, end: bool = True) -> str:
    body = "\n".join(rnd(ALNUM + "+/", 64) for _ in range(lines))
    text = "-----" + "BEGIN " + label + "-----\n" + body + "\n"
    return text + ("-----" + "END " + label + "-----" if end else "")


def jwt() -> str:
    header = b64url('{"alg":"HS256","typ":"JWT"}')
    payload = b64url('{"sub":"' + rnd(DIGITS, 10) + '","name":"dev","iat":1700000000}')
    return header + "." + payload + "." + rnd(TOKEN, 43)


# (kind, before, secret, after): scan(before + secret + after) must report exactly the secret.
POSITIVES: list[tuple[str, str, str, str]] = [
    ("private_key", "key file:\n", pem("RSA PRIVATE KEY"), "\n"),
    ("private_key", "$ cat id_ed25519\n", pem("OPENSSH PRIVATE KEY"), "\n$ "),
    ("private_key", "$ head -3 key.pem\n", pem("PRIVATE KEY", lines=2, end=False), ""),
    ("aws_access_key_id", "aws_access_key_id = ", "AK" + "IA" + rnd(UPPER + "234567", 16), "\n"),
    ("aws_access_key_id", '"AccessKeyId": "', "AS" + "IA" + rnd(UPPER + "234567", 16), '"'),
    ("aws_secret_access_key", "aws_secret_access_key = ", rnd(ALNUM + "+/", 40), "\n"),
    ("aws_secret_access_key", '{"SecretAccessKey": "', rnd(ALNUM + "+/", 40), '"}'),
    ("aws_secret_access_key", "export AWS_SECRET_ACCESS_KEY=", rnd(ALNUM + "+/", 40), ""),
    ("github_token", "GITHUB_TOKEN=", "gh" + "p_" + rnd(ALNUM, 36), "\n"),
    ("github_token", "token ", "gh" + "s_" + rnd(ALNUM, 36), " expired"),
    ("github_fine_grained_token", "", "github" + "_pat_" + rnd(ALNUM, 22) + "_" + rnd(ALNUM, 59), ""),
    ("gitlab_token", "PRIVATE-TOKEN: ", "gl" + "pat-" + rnd(TOKEN, 20), "\n"),
    ("slack_token", "SLACK_BOT_TOKEN=",
     "xo" + "xb-" + rnd(DIGITS, 12) + "-" + rnd(DIGITS, 13) + "-" + rnd(ALNUM, 24), "\n"),
    ("slack_token", "", "xa" + "pp-1-" + rnd(UPPER + DIGITS, 11) + "-" + rnd(DIGITS, 13) + "-"
     + rnd(HEX, 64), ""),
    ("slack_webhook_url", "curl -X POST ", "https://hooks.slack" + ".com/services/T" + rnd(UPPER, 9)
     + "/B" + rnd(UPPER + DIGITS, 9) + "/" + rnd(ALNUM, 24), " -d @msg.json"),
    ("stripe_secret_key", "stripe.api_key = '", "sk" + "_live_" + rnd(ALNUM, 24), "'"),
    ("stripe_secret_key", "", "rk" + "_live_" + rnd(ALNUM, 99), ""),
    ("stripe_test_key", "STRIPE_KEY=", "sk" + "_test_" + rnd(ALNUM, 24), "\n"),
    ("google_api_key", "?key=", "AI" + "za" + rnd(TOKEN, 35), "&q=x"),
    ("anthropic_api_key", "x-api-key: ", "sk-" + "ant-api03-" + rnd(TOKEN, 93) + "AA", "\n"),
    ("openai_api_key", "OPENAI_API_KEY=", "sk-" + "proj-" + rnd(TOKEN, 156), "\n"),
    ("openai_api_key", "", "sk-" + rnd(ALNUM, 48), ""),
    ("cerebras_api_key", "CEREBRAS_API_KEY=", "cs" + "k-" + rnd(LOWER + DIGITS, 48), ""),
    ("groq_api_key", "", "gs" + "k_" + rnd(ALNUM, 52), ""),
    ("huggingface_token", "HF_TOKEN=", "hf" + "_" + rnd(ALNUM, 34), "\n"),
    ("npm_token", "//registry.npmjs.org/:_authToken=", "np" + "m_" + rnd(ALNUM, 36), "\n"),
    ("pypi_token", "password = ", "py" + "pi-AgEIcHlwaS5vcmc" + rnd(TOKEN, 120), "\n"),
    ("twilio_api_key", "TWILIO_API_KEY=", "S" + "K" + rnd(HEX, 32), ""),
    ("sendgrid_api_key", "", "S" + "G." + rnd(TOKEN, 22) + "." + rnd(TOKEN, 43), ""),
    ("azure_storage_account_key", "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=",
     rnd(ALNUM + "+/", 86) + "==", ";EndpointSuffix=core.windows.net"),
    ("digitalocean_token", "", "do" + "p_v1_" + rnd(HEX, 64), ""),
    ("shopify_token", "X-Shopify-Access-Token: ", "sh" + "pat_" + rnd(HEX, 32), ""),
    ("age_secret_key", "# created: 2024\n",
     "AGE-" + "SECRET-KEY-1" + rnd("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58), "\n"),
    ("jwt", "Cookie: session=", jwt(), "; Path=/"),
    ("jwt", "Authorization: Bearer ", jwt(), "\n"),  # the specific kind wins the tie
    ("url_password", "DATABASE_URL=postgres://app:", rnd(ALNUM, 16), "@db.internal:5432/app"),
    ("url_password", "REDIS_URL=redis://:", rnd(ALNUM, 16), "@cache:6379/0"),  # no user name
    ("authorization_header", "-H 'Authorization: Bearer ", rnd(TOKEN, 40), "'"),
    ("authorization_header", "Authorization: Basic ", base64.b64encode(
        ("admin:" + rnd(ALNUM, 14)).encode()).decode(), "\r\n"),
    ("generic_secret", 'db_password = "', rnd(ALNUM + "!@#%^&*", 16), '"'),
    ("generic_secret", '{"api_key": "', rnd(ALNUM, 24), '"}'),
    ("generic_secret", "SECRET_KEY=", rnd(ALNUM + "-_", 50), "\n"),
    ("generic_secret", 'client_secret: ', rnd(ALNUM, 20), "\n"),
    ("generic_secret", '{\\"password\\": \\"', rnd(ALNUM, 18), '\\"}'),
]

# (kind, text): near misses of that kind; scan(text) must report nothing at all, except the
# few in NEGATIVE_BUT_GENERIC, which are not that kind but still a secret assignment.
NEGATIVES: list[tuple[str, str]] = [
    ("private_key", "-----" + "BEGIN PRIVATE KEY-----\n...\n-----" + "END PRIVATE KEY-----"),
    ("private_key", pem("PUBLIC KEY")),
    ("private_key", "-----" + "BEGIN RSA PRIVATE KEY-----\n"),
    ("aws_access_key_id", "AK" + "IA" + rnd(UPPER, 15)),
    ("aws_access_key_id", "AK" + "IA" + rnd(UPPER, 17)),
    ("aws_access_key_id", "AK" + "IA" + "X" * 16),
    ("aws_access_key_id", "x" + "AK" + "IA" + rnd(UPPER, 16)),
    ("aws_secret_access_key", "value = " + rnd(ALNUM + "+/", 40)),
    ("aws_secret_access_key", "aws_secret_access_key = " + rnd(ALNUM, 39)),
    ("aws_secret_access_key", "aws_secret_access_key = " + rnd(ALNUM, 41)),
    ("aws_secret_access_key", "aws_secret_access_key = " + "EXAMPLEKEY" * 4),
    ("github_token", "gh" + "p_" + rnd(ALNUM, 35)),
    ("github_token", "gh" + "x_" + rnd(ALNUM, 36)),
    ("github_token", "gh" + "p_" + "x" * 36),
    ("github_fine_grained_token", "github" + "_pat_" + rnd(ALNUM, 22) + "_" + rnd(ALNUM, 58)),
    ("gitlab_token", "gl" + "pat-" + rnd(ALNUM, 19)),
    ("gitlab_token", "gl" + "pat-" + "x" * 20),
    ("slack_token", "xo" + "xb-123-abc"),
    ("slack_token", "xo" + "xz-" + rnd(DIGITS, 12) + "-" + rnd(ALNUM, 24)),
    ("slack_webhook_url", "https://hooks.slack" + ".com/services/T000/B000/XXXX"),
    ("stripe_secret_key", "pk" + "_live_" + rnd(ALNUM, 24)),
    ("stripe_test_key", "sk" + "_test_" + rnd(ALNUM, 10)),
    ("google_api_key", "AI" + "za" + rnd(ALNUM, 34)),
    ("anthropic_api_key", "ANTHROPIC_API_KEY=sk-" + "ant-..."),
    ("openai_api_key", "OPENAI_API_KEY=sk-..."),
    ("openai_api_key", "sk-" + rnd(ALNUM, 31)),
    ("openai_api_key", "sk-" + "x" * 48),
    ("openai_api_key", "task-" + rnd(ALNUM, 40)),
    ("openai_api_key", "sk-learn-model-training-pipeline"),
    ("cerebras_api_key", "cs" + "k-" + rnd(ALNUM, 20)),
    ("groq_api_key", "gs" + "k_" + rnd(ALNUM, 20)),
    ("huggingface_token", "hf" + "_" + rnd(ALNUM, 33)),
    ("huggingface_token", "hf" + "_" + rnd(ALNUM, 35)),
    ("npm_token", "np" + "m_" + rnd(ALNUM, 35)),
    ("pypi_token", "py" + "pi-AgE" + rnd(ALNUM, 10)),
    ("twilio_api_key", "S" + "K" + rnd(HEX, 31)),
    ("twilio_api_key", "S" + "K" + rnd(HEX.upper(), 32)),
    ("sendgrid_api_key", "S" + "G." + rnd(TOKEN, 22) + "." + rnd(TOKEN, 42)),
    ("azure_storage_account_key", "AccountKey=" + rnd(ALNUM, 40)),
    ("digitalocean_token", "do" + "p_v1_" + rnd(HEX, 63)),
    ("shopify_token", "sh" + "pat_" + rnd(HEX, 31)),
    ("age_secret_key", "AGE-" + "SECRET-KEY-1" + rnd("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 57)),
    ("jwt", "eyJhbGciOi.eyJzdWIi.abc"),
    ("jwt", b64url('{"alg":"HS256","typ":"JWT"}') + "." + b64url('{"sub":"1234567890"}')),
    ("url_password", "postgres://postgres:postgres@localhost:5432/app"),
    ("url_password", "see https://example.com:8443/path@v2"),
    ("url_password", "https://:8443@host and http://localhost:8080/x"),
    ("authorization_header", 'curl -H "Authorization: Bearer $TOKEN"'),
    ("authorization_header", "Authorization: Bearer " + "a" * 24),
    ("generic_secret", "password=aaaaaaaaaaaa"),
    ("generic_secret", "password=hunter2"),
    ("generic_secret", "api_key=YOUR_API_KEY_HERE"),
    ("generic_secret", "password: ${{ secrets.DB_PASSWORD }}"),
    ("generic_secret", "max_tokens: 4096 and token_count=123456789012"),
    ("generic_secret", "tokenizer: bert-base-multilingual-cased"),
    ("generic_secret", 'password=os.environ["DB_PASSWORD"]'),
    ("generic_secret", "PASSWORD=$DB_PASSWORD_FROM_VAULT_2024"),  # shell references
    ("generic_secret", "--password=root_$MYSQL_ROOT_PASSWORD_VAR"),
    ("generic_secret", "secret=prefix_$CI_COMMIT_SHA_$CI_JOB_ID"),
    # the placeholder keys of AWS's documentation (which docs quote and models write): a span
    # ending with EXAMPLE or EXAMPLEKEY is not kept, whatever kind matched it
    ("aws_access_key_id", "aws_access_key_id = " + "AK" + "IAIOSFODNN7" + "EXAMPLE" + "\n"),
    ("aws_secret_access_key", "aws_secret_access_key = " + "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY" + "\n"),
]


NEGATIVE_BUT_GENERIC = {NEGATIVES[8][1], NEGATIVES[9][1]}  # AWS secret keys of 39 and 41 chars


@pytest.fixture(params=sorted(SCANNERS))
def scanner(request: pytest.FixtureRequest) -> Any:
    return SCANNERS[request.param]


def test_the_table_has_over_twenty_kinds_all_tested() -> None:
    kinds = [row[0] for row in PATTERNS]
    assert len(kinds) >= 20
    assert len(set(kinds)) == len(kinds)
    assert {k for k, *_ in POSITIVES} == set(kinds)
    assert {k for k, _ in NEGATIVES} == set(kinds)
    for scanner in SCANNERS.values():
        assert scanner.kinds == tuple(kinds)
        assert scanner.max_matches == 10_000


def portability_problems(pattern: str) -> list[str]:
    """What in ``pattern`` the Rust regex crate and Python's re could read differently."""
    problems = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1]
            if nxt in "wWdDsSbBAZzpPkg123456789":
                problems.append(f"\\{nxt} at {i}")  # Unicode tables, boundaries, back-refs
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == "[" or pattern[i:i + 2] in ("--", "&&", "~~"):
                problems.append(f"class set syntax at {i}")
        elif c == "[":
            in_class = True
            i += 2 if pattern[i + 1] in "^]" else 1  # a leading ^ negates, a leading ] is literal
            continue
        elif c in "^$":
            problems.append(f"anchor at {i}")
        elif pattern[i:i + 3] in ("(?=", "(?!", "(?<") or (
            pattern[i:i + 2] == "(?" and pattern[i + 2] in "aiLmsux-"
        ):
            problems.append(f"look-around or flags at {i}")
        i += 1
    return problems


@pytest.mark.parametrize("kind,pattern", [(r[0], r[1]) for r in PATTERNS], ids=[r[0] for r in PATTERNS])
def test_patterns_stay_in_the_portable_subset(kind: str, pattern: str) -> None:
    assert pattern.isascii()
    assert portability_problems(pattern) == []
    assert not re.compile(pattern).search("")


def test_the_portability_check_can_fail() -> None:
    for bad in (r"\bkey", r"(?i)key", r"^key", r"key$", r"(?<=x)key", r"[a--b]", r"(a)\1", r"\w+"):
        assert portability_problems(bad), bad
    assert portability_problems(r"[^ \t]{3}(?P<secret>x)(?:y|z)[-a]") == []


@pytest.mark.parametrize("kind,before,secret,after", POSITIVES,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(POSITIVES)])
def test_positive(scanner: Any, kind: str, before: str, secret: str, after: str) -> None:
    for prefix in ("", "\u00e9\u4e2d\U0001f600 tool output:\n"):
        text = prefix + before + secret + after
        start = len(prefix + before)
        assert scanner.scan(text) == [(kind, start, start + len(secret))]
        assert text[start:start + len(secret)] == secret


@pytest.mark.parametrize("kind,text", NEGATIVES, ids=[f"{n[0]}-{i}" for i, n in enumerate(NEGATIVES)])
def test_negative(scanner: Any, kind: str, text: str) -> None:
    if text in NEGATIVE_BUT_GENERIC:  # a high-entropy value after a "secret" keyword
        assert [k for k, _, _ in scanner.scan(text)] == ["generic_secret"]
        return
    assert scanner.scan(text) == []
    assert scanner.redact(text) == (text, [])


def test_a_pem_block_ends_at_the_next_dashes_of_the_text(scanner: Any) -> None:
    """A block's search for its END line stops at the next "--" of the text (a PEM body holds
    none): a BEGIN line with no END of its own is not stretched to a later block's END, and a
    text of many BEGIN lines is scanned in one pass, not once per BEGIN line to the text's end
    (which took 18 s for 1.8 MB on the event loop)."""
    block = pem("RSA PRIVATE KEY")
    header = "-----" + "BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,0A1B\n"
    text = header + "\n" + block
    start = len(header) + 1
    assert scanner.scan(text) == [("private_key", start, len(text))]  # the whole, ended block only
    # headers with single dashes stay inside a block
    with_info = header + "\n".join(rnd(ALNUM + "+/", 64) for _ in range(3)) + "\n-----" + "END RSA PRIVATE KEY-----"
    assert scanner.scan(with_info) == [("private_key", 0, len(with_info))]
    unit = "-----" + "BEGIN RSA PRIVATE KEY-----" + "A/b+" * 20 + " "
    many = unit * 2000
    found = scanner.scan(many)
    assert len(found) == 2000 and all(many[a:b].startswith("-----" + "BEGIN") for _, a, b in found)


def test_only_a_placeholder_s_end_spares_it(scanner: Any) -> None:
    """EXAMPLE spares a span only at its end, in capitals: a key that merely holds it is found."""
    key = "AK" + "IA" + "EXAMPLE" + rnd(UPPER + "234567", 9)
    assert [k for k, _, _ in scanner.scan("aws_access_key_id = " + key + "\n")] == ["aws_access_key_id"]
    secret = rnd(ALNUM + "+/", 33) + "example"
    assert [k for k, _, _ in scanner.scan("aws_secret_access_key = " + secret + "\n")] == ["aws_secret_access_key"]


def test_redaction(scanner: Any) -> None:
    gh = "gh" + "p_" + rnd(ALNUM, 36)
    # its own generator: drawn from the shared one, the 16 characters depended on which tests
    # ran before, and some draws fall under the generic kind's entropy threshold (3.5 bits)
    own = random.Random(16)
    pw = "".join(own.choice(ALNUM) for _ in range(16))
    text = "\u00e9 token " + gh + "\nDB_PASSWORD='" + pw + "'\n"
    out, spans = scanner.redact(text)
    assert out == "\u00e9 token [REDACTED:github_token]\nDB_PASSWORD='[REDACTED:generic_secret]'\n"
    assert spans == scanner.scan(text)
    assert [text[s:e] for _, s, e in spans] == [gh, pw]
    clean = "nothing to see here"
    assert scanner.redact(clean)[0] is clean


def test_a_token_after_a_json_escape_is_found(scanner: Any) -> None:
    # a tool output that holds JSON keeps its newlines as the two characters backslash, n: the
    # escape's letter must not glue the token to a longer word
    gh = "gh" + "p_" + rnd(ALNUM, 36)
    for escape in ("\\n", "\\t", "\\r", "\\\\\\n", "\\u003e", "\\u00E9"):
        text = '{"log": "line one' + escape + gh + '"}'
        start = text.index(gh)
        assert scanner.scan(text) == [("github_token", start, start + len(gh))], escape
    # an escaped backslash followed by a plain "n" is a letter of the word: glued, not found
    assert scanner.scan("\\\\n" + gh) == []
    assert scanner.scan("xn" + gh) == []
    assert scanner.scan("u003e" + gh) == [] and scanner.scan("\\\\u003e" + gh) == []


def test_a_truncated_private_key_in_json_redacts_to_json(scanner: Any) -> None:
    """A key without its END line, in a tool call's JSON arguments, right before an escaped
    quote: its span took the quote's backslash, and its redaction left the quote unescaped, so
    the arguments (sent to the backend, stored, resent each turn) were no longer JSON."""
    key = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA" + rnd(ALNUM, 70) + "\n" + rnd(ALNUM, 40)
    for tail in ('" > k.pem', "\\", '"'):
        args = json.dumps({"cmd": 'echo "' + key + tail})
        out, spans = scanner.redact(args)
        assert [k for k, _, _ in spans] == ["private_key"], tail
        assert json.loads(out)["cmd"].startswith('echo "[REDACTED:private_key]'), (tail, out)


def test_adjacent_and_overlapping_kinds(scanner: Any) -> None:
    key_id = "AK" + "IA" + rnd(UPPER + "234567", 16)
    other = "AS" + "IA" + rnd(UPPER + "234567", 16)
    text = key_id + " " + other + "," + key_id
    assert [k for k, _, _ in scanner.scan(text)] == ["aws_access_key_id"] * 3
    # the AWS secret key rule and the generic rule find the same span: the specific kind wins
    secret = rnd(ALNUM, 40)
    assert scanner.scan("aws_secret_access_key=" + secret) == [("aws_secret_access_key", 22, 62)]
    # an OpenAI key in a bearer header: same span, the specific kind wins
    key = "sk-" + rnd(ALNUM, 48)
    assert scanner.scan("Authorization: Bearer " + key) == [("openai_api_key", 22, 22 + len(key))]


def test_entropy_threshold_is_inclusive() -> None:
    assert _accel_entropy("aabbccddefghijkl") == 3.5
    value = "aabbccddefghijkl"  # exactly 3.5 bits per character: kept
    for scanner in SCANNERS.values():
        assert scanner.scan("password=" + value) == [("generic_secret", 9, 25)]
        assert scanner.scan("password=" + "aabbccddeeffghij") == []  # 3.25 bits


def _accel_entropy(s: str) -> float:
    from hotloop import _pure

    return _pure.shannon_entropy(s)


def test_cap_on_matches() -> None:
    keys = ["gh" + "p_" + rnd(ALNUM, 36) for _ in range(5)]
    text = " ".join(keys)
    for impl in IMPLS.values():
        capped = impl["SecretScanner"](PATTERNS, max_matches=3)
        spans = capped.scan(text)
        assert [text[s:e] for _, s, e in spans] == keys[:3]
        assert capped.redact(text)[0].count("[REDACTED:") == 3
        assert impl["SecretScanner"](PATTERNS, max_matches=0).scan(text) == []


def test_lone_surrogates_and_astral_text(scanner: Any) -> None:
    key = "np" + "m_" + rnd(ALNUM, 36)
    text = "\ud800\U0001f600 " + key + " \udfff"
    assert scanner.scan(text) == [("npm_token", 3, 3 + len(key))]
    assert scanner.redact(text)[0] == "\ud800\U0001f600 [REDACTED:npm_token] \udfff"
    # a surrogate inside a URL password is a character of its own for the entropy check
    url = "redis://u:" + "\ud800\ud801\ud802abcdefgh" + "@cache"
    assert scanner.scan(url) == [("url_password", 10, 21)]


def test_type_errors(scanner: Any) -> None:
    for bad in (b"bytes", None, 3):
        with pytest.raises(TypeError):
            scanner.scan(bad)
        with pytest.raises(TypeError):
            scanner.redact(bad)


def test_scanning_from_threads(scanner: Any) -> None:
    """Large texts are scanned with the GIL released (native); both twins work from threads."""
    keys = ["gh" + "p_" + rnd(ALNUM, 36) for _ in range(4)]
    filler = "lorem ipsum \u00e9 dolor = sit; amet, 12345\n" * 2000  # ~80 KB
    texts = [filler + k + " " + filler for k in keys]
    want = [scanner.scan(t) for t in texts]
    barrier = threading.Barrier(2)
    results: dict[int, list[Any]] = {}

    def work(n: int) -> None:
        barrier.wait()
        results[n] = [scanner.scan(t) for t in texts for _ in range(2)][::2]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: want, 1: want}
    assert all(w == [("github_token", len(filler), len(filler) + 40)] for w in want)


# -- the secrets classifier --------------------------------------------------------------------


def _items(key: str, pw: str) -> list[Any]:
    return [
        Message(role="user", content="deploy with " + key),
        Message(role="assistant", content=[OutputText(text="ok"), InputImage(image_url="x")]),
        FunctionCall(call_id="c1", name="shell", arguments='{"cmd": "export TOKEN=' + pw + '"}'),
        FunctionCallOutput(call_id="c1", output=[InputText(text="nothing"),
                                                 InputText(text="AWS key " + key)]),
        ItemReference(id="msg_1"),
        OtherItem(type="custom_tool_call_output", data={"type": "custom_tool_call_output",
                                                        "output": "pw " + key}),
    ]


KEY = "AK" + "IA" + rnd(UPPER + "234567", 16)
PW = rnd(ALNUM, 20)


def test_item_texts_paths() -> None:
    items = _items(KEY, PW)
    assert [p for it in items for p, _ in classify.item_texts(it) if p[-1] != classify.KEY] == [
        ("content",), ("content", 0, "text"), ("content", 1, "image_url"), ("name",), ("call_id",),
        ("arguments",), ("call_id",), ("output", 0, "text"), ("output", 1, "text"), ("type",), ("output",),
    ]


def _nested_items(key: str) -> list[Any]:
    """Unmodelled items whose text sits below the top level (hosted and shell tools)."""
    return [
        OtherItem(type="local_shell_call", data={
            "type": "local_shell_call", "id": "lsh_1", "call_id": "c9", "status": "completed",
            "action": {"type": "exec", "command": ["bash", "-lc", "curl -H 'x-key: " + key + "'"],
                       "env": {"AWS_ACCESS_KEY_ID": key}}}),
        OtherItem(type="shell_call_output", data={
            "type": "shell_call_output", "call_id": "c10",
            "output": [{"stdout": "ok\n", "stderr": ""}, {"stdout": "key " + key, "stderr": ""}]}),
        OtherItem(type="apply_patch_call", data={
            "type": "apply_patch_call", "call_id": "c11",
            "operation": {"type": "update_file", "path": "a.env", "diff": "+KEY=" + key + "\n"}}),
        OtherItem(type="computer_call_output", data={
            "type": "computer_call_output", "call_id": "c12",
            "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64," + key}}),
    ]


def test_nested_texts_of_unmodelled_items_are_scanned_and_redacted() -> None:
    items = _nested_items(KEY)
    assert [p for it in items for p, _ in classify.item_texts(it) if p[-1] != classify.KEY] == [
        ("type",), ("call_id",), ("status",), ("action", "type"), ("action", "command", 0),
        ("action", "command", 1), ("action", "command", 2), ("action", "env", "AWS_ACCESS_KEY_ID"),
        ("type",), ("call_id",), ("output", 0, "stdout"), ("output", 0, "stderr"),
        ("output", 1, "stdout"), ("output", 1, "stderr"), ("type",), ("call_id",),
        ("operation", "type"), ("operation", "path"), ("operation", "diff"), ("type",), ("call_id",),
        ("output", "type"),
    ]  # ids (the model never reads them) and the screenshot's inline data are not text
    for impl, scanner in SCANNERS.items():
        c = classify.SecretsClassifier("redact", scanner)
        verdict, _ = c.classify(items, c.initial_state())
        assert isinstance(verdict, classify.Redact), impl
        assert [(f.item_index, f.path) for f in verdict.findings] == [
            (0, ("action", "command", 2)), (0, ("action", "env", "AWS_ACCESS_KEY_ID")),
            (1, ("output", 1, "stdout")), (2, ("operation", "diff")),
        ]
        new = verdict.items
        assert KEY not in msgspec.json.encode([i.data for i in new[:3]]).decode()
        assert new[0].data["action"]["command"][:2] == ["bash", "-lc"]
        assert new[0].data["call_id"] == "c9" and new[0].data["id"] == "lsh_1"
        assert new[1].data["output"][0] == items[1].data["output"][0]  # untouched parts are kept
        assert new[2].data["operation"]["diff"] == "+KEY=[REDACTED:aws_access_key_id]\n"
        assert new[3] is items[3]
        assert KEY in items[0].data["action"]["command"][2]  # the originals are untouched
        block = classify.SecretsClassifier("block", scanner)
        verdict, _ = block.classify(items, block.initial_state())
        assert isinstance(verdict, classify.Block)
        assert classifiers.blocked_error(verdict).param == "input[0].action.command[2]"


def test_string_leaves_stop_at_the_depth_limit() -> None:
    deep: Any = "ghp"
    for _ in range(classify.MAX_LEAF_DEPTH + 5):
        deep = [deep]
    assert classify.string_leaves(deep, ()) == []
    assert classify.string_leaves({"a": [1, None, "x", {"b": "y"}]}, ("p",)) == [
        (("p", "a", classify.KEY), "a"), (("p", "a", 2), "x"), (("p", "a", 3, "b", classify.KEY), "b"),
        (("p", "a", 3, "b"), "y")]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_secret_in_an_object_key_is_found_and_never_redacted(impl: str) -> None:
    """Only values were scanned: a credential used as a key (a schema's property name, a
    metadata key, a key inside an unmodelled item) passed block and redact, and reached the
    backend and the store. A key cannot be redacted (it names what the JSON refers to): under
    redact it is refused, and the error's param names the object, not the key."""
    scanner = SCANNERS[impl]
    item = OtherItem(type="local_shell_call", data={"type": "local_shell_call", "call_id": "c1",
                                                    "action": {"type": "exec", "env": {KEY: "1"}}})
    for policy, want in (("flag", classify.Flag), ("redact", classify.Block), ("block", classify.Block)):
        c = classify.SecretsClassifier(policy, scanner)
        verdict, _ = c.classify([item], c.initial_state())
        assert isinstance(verdict, want), (policy, verdict)
        assert verdict.findings[0].path == ("action", "env", KEY, classify.KEY)
        if isinstance(verdict, classify.Block):
            assert classifiers.blocked_error(verdict).param == "input[0].action.env"
            assert KEY not in verdict.reason
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {KEY: {"type": "string"}}}}
    p = validate(decode_body(msgspec.json.encode({"model": "m", "input": "x", "tools": [tool], "metadata": {KEY: "v"}})))
    verdict, same = classify.SecretsClassifier("redact", scanner).classify_settings(p)
    assert isinstance(verdict, classify.Block) and same is p
    assert classifiers.blocked_error(verdict).param == "tools[0].parameters.properties"
    verdict, _ = classify.SecretsClassifier("flag", scanner).classify_settings(p)
    assert ("metadata", KEY, classify.KEY) in [f.path for f in verdict.findings]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_classifier_policies(impl: str) -> None:
    scanner = SCANNERS[impl]
    items = _items(KEY, PW)
    frozen = msgspec.json.encode(items)

    off = classify.SecretsClassifier("off", scanner)
    assert off.classify(items, off.initial_state()) == (classify.ALLOW, classify.SecretsState())

    flag = classify.SecretsClassifier("flag", scanner)
    verdict, state = flag.classify(items, flag.initial_state())
    assert isinstance(verdict, classify.Flag)
    assert verdict.labels == ("secret:aws_access_key_id", "secret:generic_secret")
    assert [(f.item_index, f.path, f.kind) for f in verdict.findings] == [
        (0, ("content",), "aws_access_key_id"),
        (2, ("arguments",), "generic_secret"),
        (3, ("output", 1, "text"), "aws_access_key_id"),
        (5, ("output",), "aws_access_key_id"),
    ]
    assert state == classify.SecretsState(
        kinds_seen=frozenset({"aws_access_key_id", "generic_secret"}), findings=4)
    # the state carries over to the chain's next turn
    verdict2, state2 = flag.classify([Message(role="user", content="thanks")], state)
    assert verdict2 == classify.ALLOW and state2 == state

    redact = classify.SecretsClassifier("redact", scanner)
    verdict, _ = redact.classify(items, redact.initial_state())
    assert isinstance(verdict, classify.Redact)
    new = verdict.items
    assert len(new) == len(items)
    assert new[0] == Message(role="user", content="deploy with [REDACTED:aws_access_key_id]")
    assert new[1] is items[1] and new[4] is items[4]
    assert isinstance(new[2], FunctionCall)
    assert new[2].arguments == '{"cmd": "export TOKEN=[REDACTED:generic_secret]"}'
    assert isinstance(new[3], FunctionCallOutput) and isinstance(new[3].output, list)
    assert new[3].output[0] is items[3].output[0]
    assert new[3].output[1] == InputText(text="AWS key [REDACTED:aws_access_key_id]")
    assert isinstance(new[5], OtherItem)
    assert new[5].data == {"type": "custom_tool_call_output",
                           "output": "pw [REDACTED:aws_access_key_id]"}
    assert KEY not in msgspec.json.encode(list(new)).decode()
    assert msgspec.json.encode(items) == frozen  # the originals are untouched

    block = classify.SecretsClassifier("block", scanner)
    verdict, _ = block.classify(items, block.initial_state())
    assert isinstance(verdict, classify.Block)
    assert "aws_access_key_id" in verdict.reason and KEY not in verdict.reason

    clean = [Message(role="user", content="hello")]
    for policy in ("flag", "redact", "block"):
        c = classify.SecretsClassifier(policy, scanner)  # type: ignore[arg-type]
        assert c.classify(clean, c.initial_state()) == (classify.ALLOW, classify.SecretsState())


def test_classifier_redact_blocks_when_the_cap_is_reached() -> None:
    for impl in IMPLS.values():
        capped = impl["SecretScanner"](PATTERNS, max_matches=2)
        c = classify.SecretsClassifier("redact", capped)
        items = [Message(role="user", content=" ".join([KEY] * 3))]
        verdict, _ = c.classify(items, c.initial_state())
        assert isinstance(verdict, classify.Block)
        assert "too many" in verdict.reason


def test_classifier_default_scanner_and_bad_policy() -> None:
    assert classify.SecretsClassifier().scanner is classify.default_secret_scanner()
    assert classify.SecretsClassifier().policy == "flag"
    with pytest.raises(ValueError):
        classify.SecretsClassifier("loud")  # type: ignore[arg-type]


def test_classifier_satisfies_the_protocol() -> None:
    c: classify.Classifier[classify.SecretsState] = classify.SecretsClassifier()
    assert c.name == "secrets"


def test_settings_chars_counts_what_the_settings_caches_do_not_hold() -> None:
    from hotloop.pipeline.settings import decode_tools
    from hotloop.protocol.request import CreateRequest, share_checked, validate

    c = classify.SecretsClassifier("flag")
    long = "y " * classify.SETTINGS_CACHE_MIN_CHARS
    raw = msgspec.json.encode([{"type": "function", "name": "f", "description": "d " * 3000}])
    shared = decode_tools(raw)
    assert shared is not None
    share_checked(shared)
    p = validate(CreateRequest(model="m", input="hi", instructions=long, tools=shared.tools, user="u" * 10))
    assert c.settings_chars(p, 10**9) == len(long) + len(shared.json) + 10
    assert c.settings_chars(p, 100) == len(long)  # counted until the limit is reached
    c.classify_settings(p)
    assert c.settings_chars(p, 10**9) == 10  # both cached: the short texts are scanned every time
    unshared = validate(CreateRequest(model="m", input="hi", tools=msgspec.json.decode(raw)))
    assert c.settings_chars(unshared, 10**9) == len(raw)  # its JSON: at least its texts
    short = validate(CreateRequest(model="m", input="hi", instructions="short"))
    c.classify_settings(short)
    assert c.settings_chars(short, 10**9) == 5
    assert classify.SecretsClassifier("off").settings_chars(p, 10**9) == 0


def test_settings_scan_cache_is_bounded_and_follows_shared_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotloop.pipeline.settings import decode_tools
    from hotloop.protocol.request import CreateRequest, share_checked, validate

    monkeypatch.setattr(classify, "SETTINGS_CACHE_ENTRIES", 3)
    c = classify.SecretsClassifier("redact")
    long = "x " * classify.SETTINGS_CACHE_MIN_CHARS
    for i in range(6):  # distinct long instructions: the cache keeps the 3 newest
        p = validate(CreateRequest(model="m", input="hi", instructions=f"{i} {long}"))
        assert c.classify_settings(p) == (classify.ALLOW, p)
    assert len(c._texts) == 3 and c._text_chars == sum(len(t) for _, t in c._texts)
    # the same long instructions again, with a key: found from the cache, redacted
    text = f"{long} {KEY}"
    for _ in range(2):
        p = validate(CreateRequest(model="m", input="hi", instructions=text))
        verdict, q = c.classify_settings(p)
        assert isinstance(verdict, classify.Redact) and KEY not in (q.req.instructions or "")
    assert ("", text) in c._texts
    # kept per owner: another key's same instructions are scanned for it (no timing tells it
    # what the first key sent), and then found too
    for _ in range(2):
        verdict, q = c.classify_settings(p, "other-key")
        assert isinstance(verdict, classify.Redact)
    assert ("other-key", text) in c._texts and c.settings_chars(p, 10**9, "third-key") >= len(text)
    # a shared tools array is scanned once; its redacted copy is checked again, the original kept
    raw = msgspec.json.encode([{"type": "function", "name": "f", "description": "key " + KEY}])
    shared = decode_tools(raw)
    assert shared is not None
    share_checked(shared)
    p = validate(CreateRequest(model="m", input="hi", tools=shared.tools))
    for _ in range(2):
        verdict, q = c.classify_settings(p)
        assert isinstance(verdict, classify.Redact)
        assert q.function_tools["f"].description == "key [REDACTED:aws_access_key_id]"
        assert q.tools is not shared.tools and KEY in shared.tools[0]["description"]
        assert [f.path for f in verdict.findings] == [("tools", 0, "description")]
    assert list(c._tools.values()) == [[(("tools", 0, "description"), [("aws_access_key_id", 4, 24)])]]


def test_many_secrets_in_one_item_are_redacted_in_one_copy() -> None:
    """Every leaf of a long list redacted: each is replaced, the original is untouched (the item
    is copied once, not once per secret)."""
    keys = ["AK" + "IA" + rnd(UPPER + "234567", 16) for _ in range(300)]
    item = OtherItem(type="custom_tool_call_output", data={"type": "custom_tool_call_output", "call_id": "c",
                                                           "output": [{"text": k} for k in keys]})
    msg = Message(role="user", content=[InputText(text=k) for k in keys])
    c = classify.SecretsClassifier("redact")
    verdict, _ = c.classify([item, msg], c.initial_state())
    assert isinstance(verdict, classify.Redact) and len(verdict.findings) == 600
    out, m = verdict.items
    assert [p["text"] for p in out.data["output"]] == ["[REDACTED:aws_access_key_id]"] * 300
    assert [p.text for p in m.content] == ["[REDACTED:aws_access_key_id]"] * 300
    assert item.data["output"][7]["text"] == keys[7] and msg.content[7].text == keys[7]


def test_settings_beyond_the_model_text_are_scanned() -> None:
    """Every tool (hosted ones too), a tool_choice object, the format's name, metadata values and
    the identifiers: redacted (identifiers dropped) or named by block."""
    from hotloop.protocol.request import CreateRequest, TextConfig, TextFormat, validate

    req = CreateRequest(
        model="m", input="hi",
        tools=[{"type": "mcp", "server_label": "gh", "headers": {"Authorization": "Bearer " + KEY}},
               {"type": "function", "name": "f", "x_note": "key " + KEY}],
        tool_choice={"type": "function", "name": "f"},
        text=TextConfig(format=TextFormat(type="json_schema", name="f" + KEY[:5], schema={"a": KEY})),
        metadata={"note": "key " + KEY}, user=KEY, safety_identifier="s", prompt_cache_key=KEY,
    )
    p = validate(req)
    verdict, q = classify.SecretsClassifier("redact").classify_settings(p)
    assert isinstance(verdict, classify.Redact)
    assert sorted(f.path for f in verdict.findings) == sorted([
        ("tools", 0, "headers", "Authorization"), ("tools", 1, "x_note"), ("text", "format", "schema", "a"),
        ("metadata", "note"), ("user",), ("prompt_cache_key",)])
    assert KEY not in msgspec.json.encode(q.req).decode() and KEY not in msgspec.json.encode(q.tools).decode()
    assert q.req.user is None and q.req.prompt_cache_key is None and q.req.safety_identifier == "s"
    assert q.req.metadata == {"note": "key [REDACTED:aws_access_key_id]"}
    assert q.function_tools["f"].name == "f" and KEY in msgspec.json.encode(p.req).decode()
    verdict, _ = classify.SecretsClassifier("block").classify_settings(p)
    assert isinstance(verdict, classify.Block)
    assert classifiers.blocked_error(verdict).param == "tools[0].headers.Authorization"


def test_only_inline_data_is_skipped_and_depth_costs_no_recursion() -> None:
    gh = "gh" + "p_" + rnd(ALNUM, 36)
    yaml = "data:\n  GITHUB_TOKEN: " + gh  # text that starts with "data:" is text
    inline = "data:image/png;base64," + gh  # an inline image is data
    deep: Any = {"leaf": "key " + gh}
    for _ in range(classify.MAX_LEAF_DEPTH - 3):  # as deep as an item may nest
        deep = [deep]
    items = [
        Message(role="user", content=[InputText(text=yaml), InputImage(image_url=inline)]),
        OtherItem(type="custom_tool_call", data={"type": "custom_tool_call", "call_id": "c", "name": "n",
                                                 "input": "x " + gh, "deep": deep, "image_url": inline}),
    ]
    c = classify.SecretsClassifier("redact")
    verdict, _ = c.classify(items, c.initial_state())
    assert isinstance(verdict, classify.Redact)
    deep_path = ("deep", *[0] * (classify.MAX_LEAF_DEPTH - 3), "leaf")
    assert [(f.item_index, f.path) for f in verdict.findings] == [
        (0, ("content", 0, "text")), (1, ("input",)), (1, deep_path)]
    new = verdict.items
    assert new[0].content[0].text == "data:\n  GITHUB_TOKEN: [REDACTED:github_token]"
    assert new[0].content[1] is items[0].content[1] and new[1].data["image_url"] == inline
    leaf = new[1].data
    for key in deep_path[:-1]:
        leaf = leaf[key]
    assert leaf == {"leaf": "key [REDACTED:github_token]"} and gh in str(items[1].data["deep"])
    assert classifiers.blocked_error(classify.Block(reason="r", findings=verdict.findings[2:])).param.startswith(
        "input[1].deep[0][0]")


def test_a_secret_in_a_name_is_refused_under_redact() -> None:
    from hotloop.protocol.request import CreateRequest, validate

    gh = "gh" + "p_" + rnd(ALNUM, 36)
    p = validate(CreateRequest(model="m", input="hi", tools=[{"type": "function", "name": gh, "description": "d " + gh}]))
    verdict, q = classify.SecretsClassifier("redact").classify_settings(p)
    assert isinstance(verdict, classify.Block) and q is p
    assert classifiers.blocked_error(verdict).param == "tools[0].name"
    assert "cannot be redacted" in verdict.reason and gh not in verdict.reason


def _item_with(field: str, secret: str) -> dict[str, Any]:
    if field == "file_data":
        return {"role": "user", "content": [{"type": "input_file", "file_data": "see " + secret, "filename": "a.txt"}]}
    if field == "filename":
        return {"role": "user", "content": [{"type": "input_file", "file_id": "file_1", "filename": secret + ".txt"}]}
    if field == "annotations":
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "see",
                "annotations": [{"type": "url_citation", "url": "https://x.test/?k=" + secret, "title": "t",
                                 "start_index": 0, "end_index": 3}]}]}
    if field == "encrypted_content":
        return {"type": "reasoning", "summary": [], "encrypted_content": secret}
    assert field == "phase"
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}], "phase": secret}


@pytest.mark.parametrize("field", ["file_data", "filename", "annotations", "encrypted_content", "phase"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_every_stored_string_of_an_item_is_scanned_and_redacted(impl: str, field: str) -> None:
    """These were never scanned: under block the request completed, under redact the secret
    was stored (and a file's text sent to a backend that takes files)."""
    from hotloop.protocol.request import decode_items

    items = decode_items([_item_with(field, KEY)])
    block = classify.SecretsClassifier("block", SCANNERS[impl])
    assert isinstance(block.classify(items, block.initial_state())[0], classify.Block)
    redact = classify.SecretsClassifier("redact", SCANNERS[impl])
    verdict, _ = redact.classify(items, redact.initial_state())
    assert isinstance(verdict, classify.Redact)
    out = msgspec.json.encode(verdict.items).decode()
    assert KEY not in out and "[REDACTED:aws_access_key_id]" in out
    assert KEY in msgspec.json.encode(items).decode()  # the originals are untouched


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"text": {"format": {"type": "json_schema", "name": "n", "schema": "DEEP"}}}, "text.format.schema"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "DEEP"}},
         "tool_choice"),
    ],
    ids=["schema", "tool_choice"],
)
def test_an_output_schema_or_a_tool_choice_nested_past_the_bound_is_refused(extra: dict[str, Any], param: str) -> None:
    """Scanned only 256 levels deep, and never bounded: a secret deeper passed block and redact,
    and went to the backend and the store."""
    from hotloop import errors as errs

    deep: Any = KEY
    for _ in range(300):
        deep = {"a": deep}
    body = msgspec.json.encode({"model": "m", "input": "x", **extra}).replace(b'"DEEP"', msgspec.json.encode(deep))
    with pytest.raises(errs.InvalidValue) as ei:
        validate(decode_body(body))
    assert ei.value.param == param


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_secret_split_across_parts_the_backend_joins_is_found_and_redacted(impl: str) -> None:
    """A backend reads an assistant message's, a tool output's and a reasoning item's text parts
    joined with nothing between them: a key split across two or three parts (a tool output
    streamed in pieces) reached the model whole, no part holding all of it. Under redact the
    first part it touches gets the marker and the rest of it is cut from the others; under flag
    and block it is one finding; a part's own secrets are redacted as ever beside it."""
    scanner = SCANNERS[impl]
    tok = "ghp_" + rnd(ALNUM, 36)
    items = [
        decode_item({"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": "here: " + tok[:12]}, {"type": "input_text", "text": tok[12:] + " end"}]}, 0),
        decode_item({"role": "assistant", "content": [
            {"type": "output_text", "text": KEY + " x " + tok[:5]}, {"type": "output_text", "text": tok[5:20]},
            {"type": "output_text", "text": tok[20:] + " y"}]}, 1),
        decode_item({"type": "reasoning", "id": "rs_1", "content": [
            {"type": "reasoning_text", "text": tok[:30]}, {"type": "reasoning_text", "text": tok[30:]}]}, 2),
        decode_item({"type": "function_call_output", "call_id": "c", "output": [  # nothing crosses
            {"type": "input_text", "text": "ab"}, {"type": "input_text", "text": "cd"}]}, 3),
    ]
    c = classify.SecretsClassifier("redact", scanner)
    verdict, state = c.classify(items, c.initial_state())
    assert isinstance(verdict, classify.Redact)
    out, msg, rs, same = verdict.items
    assert [p.text for p in out.output] == ["here: [REDACTED:github_token]", " end"]  # type: ignore[union-attr]
    assert [p.text for p in msg.content] == [  # type: ignore[union-attr]
        "[REDACTED:aws_access_key_id] x [REDACTED:github_token]", "", " y"]
    assert [p.text for p in rs.content] == ["[REDACTED:github_token]", ""]  # type: ignore[union-attr]
    assert same is items[3]
    assert [(f.item_index, f.kind) for f in verdict.findings] == [
        (0, "github_token"), (1, "aws_access_key_id"), (1, "github_token"), (2, "github_token")]
    assert state.findings == 4
    # a secret a part holds whole, the next part starting with letters: that part is not cut
    whole = decode_item({"role": "assistant", "content": [
        {"type": "output_text", "text": "key " + tok}, {"type": "output_text", "text": "fine"}]}, 0)
    verdict, state = c.classify([whole], c.initial_state())
    assert isinstance(verdict, classify.Redact) and state.findings == 1
    assert [p.text for p in verdict.items[0].content] == ["key [REDACTED:github_token]", "fine"]  # type: ignore[union-attr]
    for policy, want in (("flag", classify.Flag), ("block", classify.Block)):
        c = classify.SecretsClassifier(policy, scanner)  # type: ignore[arg-type]
        verdict, _ = c.classify(items[:1], c.initial_state())
        assert isinstance(verdict, want) and verdict.findings[0].path == ("output", 0, "text")


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_secret_its_object_key_names_is_found_in_the_value(impl: str) -> None:
    """The keyword kinds (a password, an Authorization header) need the key and the value
    together, and structured fields were scanned one string at a time: ``{"PGPASSWORD": ...}``
    in a shell call's env, an MCP tool's ``headers``, ``metadata.password`` reached the backend
    and the store. The value is redacted (the key stays: it names what the JSON refers to)."""
    scanner = SCANNERS[impl]
    c = classify.SecretsClassifier("redact", scanner)
    env = {"PGPASSWORD": PW + "!x9", "HOME": "/root", "api_key_name": "production"}
    item = OtherItem(type="local_shell_call", data={"type": "local_shell_call", "call_id": "c1",
                                                    "action": {"type": "exec", "command": ["ls"], "env": env}})
    verdict, _ = c.classify([item], c.initial_state())
    assert isinstance(verdict, classify.Redact), verdict
    assert verdict.items[0].data["action"]["env"] == {  # type: ignore[union-attr]
        "PGPASSWORD": "[REDACTED:generic_secret]", "HOME": "/root", "api_key_name": "production"}
    assert [f.path for f in verdict.findings] == [("action", "env", "PGPASSWORD")]
    bearer = "Zq8" + rnd(ALNUM, 24)
    tool = {"type": "mcp", "server_label": "x", "server_url": "https://x.example", "headers": {"Authorization": "Bearer " + bearer}}
    p = validate(decode_body(msgspec.json.encode(
        {"model": "m", "input": "x", "tools": [tool], "metadata": {"password": PW + "!x9", "note": "hello"}})))
    verdict, out = c.classify_settings(p)
    assert isinstance(verdict, classify.Redact)
    assert [f.path for f in verdict.findings] == [("tools", 0, "headers", "Authorization"), ("metadata", "password")]
    assert out.tools[0]["headers"] == {"Authorization": "Bearer [REDACTED:authorization_header]"}
    assert out.req.metadata == {"password": "[REDACTED:generic_secret]", "note": "hello"}
    assert bearer not in msgspec.json.encode(out.tools).decode()
    # a value the scanner finds alone is one finding, not two
    alone = OtherItem(type="x_call", data={"type": "x_call", "token": KEY})
    verdict, _ = c.classify([alone], c.initial_state())
    assert isinstance(verdict, classify.Redact) and len(verdict.findings) == 1
    assert verdict.items[0].data["token"] == "[REDACTED:aws_access_key_id]"  # type: ignore[union-attr]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_password_is_redacted_to_its_end_not_to_the_first_character_its_class_lacks(impl: str) -> None:
    """The scanner's password value stops at the first character its class does not hold ("$",
    ".", "(", "ñ"): ``DB_PASSWORD=Kx9mQ2vL7pZ4$wR8tY`` was stored as ``...]$wR8tY``. The value is
    redacted on to the next white space, quote, comma or backslash; what follows stays."""
    c = classify.SecretsClassifier("redact", SCANNERS[impl])
    head = "Kx9mQ2vL7pZ4"
    for tail, after in (("$wR8tY", " next"), (".wR8tY", '", x'), ("(abc)", ";"), ("ñab", "\\nmore"), ("", " x")):
        text = f"DB_PASSWORD={head}{tail}{after}"
        item = Message(role="user", content=[InputText(text=text)])
        verdict, _ = c.classify([item], c.initial_state())
        assert isinstance(verdict, classify.Redact), text
        assert verdict.items[0].content[0].text == "DB_PASSWORD=[REDACTED:generic_secret]" + after, text  # type: ignore[union-attr]
        assert (verdict.findings[0].start, verdict.findings[0].end) == (12, 12 + len(head + tail))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_keyword_in_one_part_names_the_secret_in_the_next(impl: str) -> None:
    """A keyword kind split at its key (``["export DB_PASSWORD=", "Kx9m..."]``): the joined scan
    found it inside the second part, which its own scan could not (the keyword is in the first),
    and it was skipped as found. A password value that runs on into the next part, or whose
    value class ends early there, is cut to its end in every part."""
    scanner = SCANNERS[impl]
    c = classify.SecretsClassifier("redact", scanner)
    bearer = "Zq8" + rnd(ALNUM, 24)

    def parts(*texts: str) -> Any:
        return decode_item({"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": t} for t in texts]}, 0)

    cases = [
        (("export DB_PASSWORD=", "Kx9mQ2vL7pZ4wR8t\n"), ["export DB_PASSWORD=", "[REDACTED:generic_secret]\n"]),
        (('{"Authorization": "Bearer ', bearer + '"}'), ['{"Authorization": "Bearer ', '[REDACTED:authorization_header]"}']),
        (("DB_PASSWORD=Kx9mQ2vL7pZ4", "wR8tYq3N next"), ["DB_PASSWORD=[REDACTED:generic_secret]", " next"]),
        (("DB_PASSWORD=Kx9m", "Q2vL7pZ4wR8t$tail99 next"), ["DB_PASSWORD=[REDACTED:generic_secret]", " next"]),
    ]
    for texts, want in cases:
        verdict, _ = c.classify([parts(*texts)], c.initial_state())
        assert isinstance(verdict, classify.Redact), texts
        assert [p.text for p in verdict.items[0].output] == want, texts  # type: ignore[union-attr]
        assert len(verdict.findings) == 1, verdict.findings
        block = classify.SecretsClassifier("block", scanner)
        assert isinstance(block.classify([parts(*texts)], block.initial_state())[0], classify.Block), texts
