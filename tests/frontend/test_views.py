"""The pages on the server side, without a browser: access, roles, the plotly bundle, no external URLs,
the editor's dry-run check, its NumPy upload of editing directions and the audit filters."""

from __future__ import annotations

import dataclasses
import gzip
import html
import importlib.resources
import io
import json
import re

import numpy as np
import pytest
import torch
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.common.redis import get_redis
from controlplane.policies import selectors as policy_selectors
from controlplane.policies import services as policy_services
from frontend.policy_fields import FIELD_GROUPS
from relay_engine.core.config import ModelFingerprint, parse_policy, tier_policy_type, validate_policy
from relay_engine.core.editing_io import editing_json, write_editing_npz
from relay_engine.core.outcomes import TIER_LABELS, TIERS
from relay_engine.core.telemetry import REFUSAL_REASONS
from relay_engine.lab.editing.directions import build_editing
from tests.controlplane.fleet_helpers import FakeWorker
from tests.models import random_lowrank

POOL = "ranking-a"
PASSWORD = "correct horse battery staple"
PAGES = ["/", f"/pools/{POOL}/", f"/pools/{POOL}/config/", f"/pools/{POOL}/fleet/", f"/pools/{POOL}/instances/{POOL}.3/",
         "/audit/"]


@pytest.fixture
def pool(db, settings):
    settings.REDIS_URL = None  # created in the database only; the pages do not need Redis to render
    return policy_services.pool_create(name=POOL, description="a pool", expected_instances=2, actor="fixture")


def _browser(username: str, role: Role | None) -> Client:
    if role is None:
        get_user_model().objects.create_user(username=username, password=PASSWORD)
    else:
        account_services.user_create(username=username, role=role, password=PASSWORD, actor="fixture")
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return client


@pytest.fixture
def operator(db):
    return _browser("sre", Role.OPERATOR)


@pytest.fixture
def viewer(db):
    return _browser("pm", Role.VIEWER)


@pytest.mark.parametrize("path", PAGES)
def test_pages_send_an_anonymous_visitor_to_the_login_page(pool, path):
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_login_page_logs_in_and_lands_on_the_overview(pool, operator):
    client = Client()
    response = client.post("/login/", {"username": "sre", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200


def test_logout_needs_a_post(operator):
    assert operator.get("/logout/").status_code == 405
    assert operator.post("/logout/").status_code == 302
    assert operator.get("/").status_code == 302


@pytest.mark.parametrize("path", [*PAGES, "/api/docs/", "/api/redoc/"])
def test_pages_reference_nothing_outside_the_server(pool, operator, path):
    html = operator.get(path).content.decode()
    external = re.findall(r"""(?:src|href|action)\s*=\s*["']((?:https?:)?//[^"']+)""", html)
    assert external == []
    # a CDN host named anywhere (cdn.plot.ly, a script loader's URL); as a word, not inside a random CSRF token
    assert not re.search(r"(?i)\bcdn\b", html)


@pytest.mark.parametrize("path", [*PAGES, "/login/", "/api/docs/", "/api/redoc/", "/api/v1/pools/"])
def test_every_page_forbids_inline_and_outside_scripts(pool, operator, path):
    policy = operator.get(path, HTTP_ACCEPT="text/html")["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'self'"
    assert all("http" not in sources and "*" not in sources for sources in directives.values()), policy


def test_a_page_without_charts_allows_no_inline_style(pool, operator):
    policy = operator.get("/audit/")["Content-Security-Policy"]
    assert "style-src 'self';" in f"{policy};"


def test_plotly_is_served_from_the_installed_package_with_long_caching(pool, operator):
    bundle = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    page = operator.get(f"/pools/{POOL}/").content.decode()
    url = re.search(r'<script src="(/vendor/plotly\.min\.js\?v=[\d.]+)"', page)
    assert url, "the live view loads plotly.js from this server, versioned"
    plain = Client().get(url.group(1))
    assert plain.content == bundle
    assert "immutable" in plain["Cache-Control"] and "max-age=31536000" in plain["Cache-Control"]
    zipped = Client().get("/vendor/plotly.min.js", HTTP_ACCEPT_ENCODING="gzip, br")
    assert zipped["Content-Encoding"] == "gzip" and gzip.decompress(zipped.content) == bundle
    assert Client().get("/vendor/plotly.min.js", HTTP_IF_NONE_MATCH=plain["ETag"]).status_code == 304


def test_redoc_is_served_from_this_server_without_the_logo_it_would_fetch_from_outside(pool, operator):
    page = operator.get("/api/redoc/").content.decode()
    url = re.search(r'<script src="([^"]+)"', page).group(1)
    assert url == "/vendor/redoc.standalone.js"
    served = operator.get(url)
    bundle = (importlib.resources.files("drf_spectacular_sidecar") / "static" / "drf_spectacular_sidecar" / "redoc"
              / "bundles" / "redoc.standalone.js").read_bytes()
    assert b"cdn.redoc.ly" in bundle and b"cdn.redoc.ly" not in served.content
    assert len(served.content) > 0.99 * len(bundle)  # the rest of ReDoc as the package ships it
    assert operator.get(url, HTTP_IF_NONE_MATCH=served["ETag"]).status_code == 304


def _reason_names_in(text: str) -> list[str]:
    """The reasons a script spells: as a name (``not_at_risk``), or quoted where the name is also an
    ordinary word (``"disabled"``, not ``button.disabled``)."""
    return [reason for reason in REFUSAL_REASONS
            if re.search(rf"\b{reason}\b" if "_" in reason else rf"[\"'`]{reason}[\"'`]", text)]


def test_the_scripts_spell_no_refusal_reason_the_page_gets_them_from_the_server(pool, operator):
    static = importlib.resources.files("frontend") / "static" / "frontend"
    assert {f.name: _reason_names_in(f.read_text()) for f in static.iterdir() if f.name.endswith(".js")} == \
        {f.name: [] for f in static.iterdir() if f.name.endswith(".js")}
    page = operator.get(f"/pools/{POOL}/").content.decode()
    reasons = json.loads(html.unescape(re.search(r'data-refusal-reasons="([^"]*)"', page).group(1)))
    assert [r["reason"] for r in reasons] == list(REFUSAL_REASONS)
    assert [r["reason"] for r in reasons if not r["refusal"]] == ["already_cached"]


def test_the_fleet_page_takes_its_tier_columns_from_the_server_and_names_no_tier_itself(pool, operator):
    page = operator.get(f"/pools/{POOL}/fleet/").content.decode()
    tiers = json.loads(html.unescape(re.search(r'data-cache-tiers="([^"]*)"', page).group(1)))
    assert [(t["tier"], t["label"]) for t in tiers] == [(str(t), TIER_LABELS[t]) for t in TIERS]
    script = (importlib.resources.files("frontend") / "static" / "frontend" / "fleet.js").read_text()
    template = page[page.index('data-role="instances"'):page.index("</table>")]
    assert not [t for t in TIERS for text in (script, template) if re.search(rf"\b{t}_|[\"'`]{t}[\"'`]", text)]
    assert not [t for t in TIERS if TIER_LABELS[t] in template]


def test_overview_without_pools_explains_how_to_start(db):
    admin = _browser("root", Role.ADMIN)
    html = admin.get("/").content.decode()
    assert "No pools yet" in html and "python -m workers.pool" in html
    assert 'id="create-pool"' in html
    viewer = _browser("pm", Role.VIEWER)
    assert 'id="create-pool"' not in viewer.get("/").content.decode()


def test_a_user_without_a_role_is_told_to_ask_for_one(pool):
    response = _browser("nobody", None).get(f"/pools/{POOL}/")
    assert response.status_code == 403
    assert b"holds no role" in response.content


def test_an_unknown_pool_is_a_page_listing_the_pools(pool, operator):
    response = operator.get("/pools/no-such-pool/")
    assert response.status_code == 404
    assert b"No pool named" in response.content and f"/pools/{POOL}/".encode() in response.content


def test_the_editor_gives_operators_inputs_and_viewers_none(pool, operator, viewer):
    editable = operator.get(f"/pools/{POOL}/config/").content.decode()
    assert 'data-path="cache.hbm_budget_mb"' in editable and 'data-role="publish"' in editable
    read_only = viewer.get(f"/pools/{POOL}/config/").content.decode()
    assert "<input" not in read_only.split("<main>")[1].split("</main>")[0].replace('type="hidden"', "")
    assert 'data-role="publish"' not in read_only and "read-only for you" in read_only


def _check(client, spec):
    return client.post(f"/ui/pools/{POOL}/check/", {"spec": spec}, content_type="application/json")


def test_the_editor_offers_the_disk_tier_as_a_section_to_turn_on_and_viewers_read_whether_it_is(
        pool, operator, viewer):
    editable = operator.get(f"/pools/{POOL}/config/").content.decode()
    assert 'type="checkbox" data-section="cache.disk"' in editable
    assert all(f'data-path="cache.disk.{name}"' in editable for name in ("path", "budget_mb", "ttl_ms"))
    assert 'data-error-for="cache.disk.path"' in editable and 'data-error-for="cache.disk"' in editable
    assert '<output data-section="cache.disk">' in viewer.get(f"/pools/{POOL}/config/").content.decode()


def test_every_form_field_is_a_field_of_the_schema_and_the_disk_section_has_them_all():
    for group in FIELD_GROUPS:
        for f in group.fields:
            spec: dict = {"cache": {"disk": {"path": "/var/tmp/kv"}}}  # valid but for the one field
            *parents, leaf = f.path.split(".")
            node = spec
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = object()  # no value of any schema type: an error at that path, never "unknown field"
            _, errors = validate_policy(spec)
            assert list(errors) == [f.path] and "unknown field" not in errors[f.path][0], (f.path, errors)
            assert not group.section or f.path.startswith(f"{group.section}.")
    [disk] = [group for group in FIELD_GROUPS if group.section == "cache.disk"]
    assert {f.path for f in disk.fields} == {f"cache.disk.{field.name}" for field in dataclasses.fields(tier_policy_type("disk"))}


def test_a_field_the_live_spec_leaves_out_is_shown_at_the_schemas_default_and_checks_to_the_same_hash(
        pool, operator):
    """An added field (``cache.enabled``) is absent from a spec that holds its default: the form must show
    the default (a bool read as ``Boolean(undefined)`` would turn the cache off on every edit), and the spec
    the form then sends carries the default, which checks to the live revision's hash."""
    live = policy_selectors.revision_desired(pool=pool)
    assert "enabled" not in live.spec["cache"]
    page = operator.get(f"/pools/{POOL}/config/")
    fields = {f["path"]: f for f in page.context["editor_state"]["fields"]}
    assert fields["cache.enabled"]["default"] is True and fields["trigger.admit_all"]["default"] is False
    assert all(f["default"] is None for f in fields.values() if f["section"])
    body = _check(operator, {**live.spec, "cache": {**live.spec["cache"], "enabled": True}}).json()
    assert body["valid"] is True and body["changes"] == [] and body["sha256"] == live.sha256


def test_the_check_names_the_disk_tiers_errors_by_field(pool, operator):
    body = _check(operator, {"cache": {"disk": {"path": "relative/kv", "budget_mb": -5}}}).json()
    assert body["valid"] is False and set(body["errors"]) == {"cache.disk.path", "cache.disk.budget_mb"}


def test_a_spec_with_the_disk_tier_left_off_checks_to_the_live_revisions_hash(pool, operator):
    live = policy_selectors.revision_desired(pool=pool)
    assert "disk" not in live.spec["cache"]
    body = _check(operator, live.spec).json()
    assert body["valid"] is True and body["changes"] == [] and body["sha256"] == live.sha256
    on = _check(operator, {**live.spec, "cache": {**live.spec["cache"], "disk": {"path": "/var/tmp/kv"}}}).json()
    assert on["valid"] is True and on["sha256"] != live.sha256
    assert {c["path"] for c in on["changes"]} and all(c["path"].startswith("cache.disk") for c in on["changes"])


def test_the_check_reports_schema_errors_by_field_path(pool, operator):
    body = _check(operator, {"trigger": {"max_preinfer_inflight": -1}, "cache": {"hbm_budget_mb": "lots"}}).json()
    assert body["valid"] is False
    assert body["errors"] == {
        "trigger.max_preinfer_inflight": ["must be in [0, 100000], got -1"],
        "cache.hbm_budget_mb": ["must be a number in [0, 16777216], got 'lots'"],
    }


def test_the_check_diffs_a_valid_spec_against_the_live_revision(pool, operator):
    body = _check(operator, {"trigger": {"at_risk_seq_len": 256}}).json()
    assert body["valid"] is True and body["against"] == 1
    assert body["changes"] == [{"path": "trigger.at_risk_seq_len", "op": "changed", "before": 512, "after": 256}]


def test_the_check_names_the_sha256_of_the_revision_a_valid_spec_would_be(pool, operator):
    spec = {"trigger": {"at_risk_seq_len": 256}}
    assert _check(operator, spec).json()["sha256"] == parse_policy(spec).sha256()
    assert _check(operator, {"trigger": {"at_risk_seq_len": -1}}).json()["sha256"] is None


def test_the_check_refuses_an_edit_for_another_model_than_the_pools_instances_serve(
        pool, operator, settings, redis_url, key_prefix):
    """The instances would NACK it; the editor says so before anything is published, naming both models."""
    settings.REDIS_URL = redis_url
    worker = FakeWorker(get_redis(), POOL, 0, prefix=key_prefix)
    worker.status.model_num_layers, worker.status.model_num_heads, worker.status.model_head_dim = 2, 2, 16
    worker.heartbeat()
    edit = {"layer": 0, "head": 1, "alpha": 0.5}
    other = {"fingerprint": {"num_layers": 4, "num_heads": 4, "head_dim": 8}, "edits": [{**edit, "direction": [0.1] * 8}]}
    body = _check(operator, {"editing": other}).json()
    assert body["valid"] is False and body["sha256"] is None
    assert body["errors"] == {"editing.fingerprint": [
        "targets 4 layers × 4 heads × head_dim 8, but this pool's live instances serve 2 layers × 2 heads × "
        "head_dim 16 (ranking-a.0): they would refuse it (NACK). Fit the edit on the pool's model."]}
    served = {"fingerprint": {"num_layers": 2, "num_heads": 2, "head_dim": 16}, "edits": [{**edit, "direction": [0.1] * 16}]}
    assert _check(operator, {"editing": served}).json()["valid"] is True


def test_the_check_needs_a_session_and_a_json_body(pool, operator):
    assert _check(Client(), {}).status_code == 401
    assert operator.post(f"/ui/pools/{POOL}/check/", "nope", content_type="application/json").status_code == 400
    assert operator.post("/ui/pools/nope/check/", {"spec": {}}, content_type="application/json").status_code == 404


def test_the_checks_refusals_come_in_the_apis_error_shape(pool, operator):
    anonymous = _check(Client(), {})
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"] == "Session"
    assert set(anonymous.json()) == {"detail"}
    no_role = _check(_browser("nobody", None), {})
    assert no_role.status_code == 403
    assert no_role.json() == {"detail": "Your account holds no role; ask an admin for viewer, operator or admin."}
    no_spec = operator.post(f"/ui/pools/{POOL}/check/", {"spc": {}}, content_type="application/json")
    assert no_spec.status_code == 400
    assert no_spec.json() == {"detail": "Invalid input: spec: This field is required.",
                              "errors": {"spec": ["This field is required."]}}
    unknown = operator.post("/ui/pools/nope/check/", {"spec": {}}, content_type="application/json").json()
    assert set(unknown) == {"detail"} and "nope" in unknown["detail"]


def test_the_json_endpoints_take_no_token(pool, db):
    """They belong to the pages: an API token is no session there (the API takes it)."""
    user = account_services.user_create(username="bot", role=Role.ADMIN, actor="fixture")
    key = account_services.token_create(user=user, actor="fixture").key
    response = Client().post(f"/ui/pools/{POOL}/check/", {"spec": {}}, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Token {key}")
    assert response.status_code == 401


def test_the_json_endpoints_are_not_in_the_api_schema(pool, viewer):
    paths = viewer.get("/api/schema/?format=json").json()["paths"]
    assert paths and not [path for path in paths if path.startswith("/ui/")]


def test_audit_log_filters_by_action_and_reports_bad_filters(pool, operator):
    html = operator.get("/audit/", {"action": "pool.create"}).content.decode()
    assert "pool.create" in html and "user.create</span>" not in html
    bad = operator.get("/audit/", {"since": "yesterday"}).content.decode()
    assert "since:" in bad and "No entries match" in bad


# --- the editor's NumPy upload of editing directions ----------------------------------------------

FP = {"num_layers": "2", "num_heads": "2"}  # head_dim comes from the array


def _npy(array: np.ndarray, name: str = "directions.npy") -> SimpleUploadedFile:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return SimpleUploadedFile(name, buffer.getvalue(), content_type="application/octet-stream")


def _upload(client, file, **form):
    return client.post(f"/ui/pools/{POOL}/editing-upload/", {"file": file, **form})


def _refused(response) -> dict:
    """The body of an upload refused as invalid: a 400 in the API's error shape (detail, errors by path)."""
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"detail", "errors"} and body["detail"].startswith("Invalid input: ")
    return body


def test_npy_directions_with_rows_become_an_editing_section_the_check_accepts(pool, operator):
    directions = np.arange(32, dtype=np.float32).reshape(2, 16) / 10
    response = _upload(operator, _npy(directions), rows="0 1 2.5\n1, 0, -1", scope="all", **FP)
    assert response.status_code == 200
    body = response.json()
    assert body["valid"] is True and body["errors"] == {}
    section = body["editing"]
    assert section["fingerprint"] == {"num_layers": 2, "num_heads": 2, "head_dim": 16}
    assert section["scope"] == "all"
    assert [(e["layer"], e["head"], e["alpha"]) for e in section["edits"]] == [(0, 1, 2.5), (1, 0, -1.0)]
    assert np.allclose([e["direction"] for e in section["edits"]], directions)
    assert section["provenance"]["uploaded_file"] == "directions.npy"
    spec, errors = validate_policy({"editing": section})
    assert errors == {} and spec.editing.content_hash() == body["content_hash"]
    check = _check(operator, {"editing": section}).json()
    assert check["valid"] is True
    added = {c["path"]: c["after"] for c in check["changes"] if c["op"] == "added"}
    assert added["editing.edits[0].alpha"] == 2.5 and added["editing.scope"] == "all"


def test_the_evals_npz_uploads_to_the_same_content_hash_as_its_json(pool, operator, tmp_path):
    fp = ModelFingerprint(3, 4, 8)
    g = torch.Generator().manual_seed(0)
    dirs = {(2, 1): torch.randn(8, generator=g), (0, 3): torch.randn(8, generator=g)}
    cfg = build_editing(fp, dirs, 3.0, scope="candidates",
                                provenance={"method": "iti", "k": 2, "dataset_hash": "abc"})
    path = write_editing_npz(cfg, tmp_path / "gr_editing.npz")
    body = _upload(operator, SimpleUploadedFile("gr_editing.npz", path.read_bytes())).json()
    assert body["valid"] is True
    assert body["content_hash"] == editing_json(cfg)["content_hash"]
    assert body["editing"] == json.loads(json.dumps(editing_json(cfg)["editing"]))


def lowrank_editing(fp: ModelFingerprint, *, alpha: float = 1.5, with_bias: bool = False):
    section = random_lowrank(fp, seed=3, rank=4, alpha=alpha)
    if with_bias:
        section["edits"] = [{"layer": 1, "head": 0, "alpha": 2.0, "direction": [0.25] * fp.head_dim}]
    return parse_policy({"editing": {**section, "provenance": {"method": "lowrank"}}}).editing


@pytest.mark.parametrize("with_bias", [False, True])
def test_an_npz_of_lowrank_maps_uploads_to_the_same_content_hash_as_its_json(pool, operator, tmp_path, with_bias):
    cfg = lowrank_editing(ModelFingerprint(3, 4, 8), with_bias=with_bias)
    path = write_editing_npz(cfg, tmp_path / "gr_editing.npz")
    body = _upload(operator, SimpleUploadedFile("gr_editing.npz", path.read_bytes())).json()
    assert body["valid"] is True, body["errors"]
    assert body["content_hash"] == editing_json(cfg)["content_hash"]
    assert body["editing"] == json.loads(json.dumps(editing_json(cfg)["editing"]))
    assert len(body["editing"]["lowrank"]) == 3 and len(body["editing"]["edits"]) == int(with_bias)


def test_lowrank_arrays_of_inconsistent_shapes_are_a_file_error(pool, operator, tmp_path):
    path = write_editing_npz(lowrank_editing(ModelFingerprint(3, 4, 8)), tmp_path / "maps.npz")
    with np.load(path, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["lowrank_source_bias"] = arrays["lowrank_source_bias"][:, :2]  # rank 2 against rotations of rank 4
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    body = _refused(_upload(operator, SimpleUploadedFile("maps.npz", buffer.getvalue())))
    assert list(body["errors"]) == ["file"]
    assert "lowrank_rotation" in body["errors"]["file"][0]
    del arrays["lowrank_alphas"]
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    body = _upload(operator, SimpleUploadedFile("maps.npz", buffer.getvalue())).json()
    assert body["errors"] == {"file": ["low-rank maps need lowrank_layers, lowrank_heads, lowrank_rotation, "
                                       "lowrank_source_weight, lowrank_source_bias, lowrank_alphas; "
                                       "missing lowrank_alphas"]}


def test_lowrank_values_the_schema_refuses_are_reported_at_their_paths(pool, operator, tmp_path):
    path = write_editing_npz(lowrank_editing(ModelFingerprint(3, 4, 8)), tmp_path / "maps.npz")
    with np.load(path, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["lowrank_layers"][2] = 7
    arrays["lowrank_rotation"][0, 1, 5] = np.inf
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    body = _upload(operator, SimpleUploadedFile("maps.npz", buffer.getvalue())).json()
    assert body["errors"] == {"editing.lowrank[2].layer": ["must be in [0, 2], got 7"],
                              "editing.lowrank[0].rotation[1]": ["must hold finite numbers; bad values at indices [5]"]}


def test_upload_errors_are_reported_by_field(pool, operator):
    directions = np.ones((3, 16))
    directions[1, 4] = np.nan
    body = _refused(_upload(operator, _npy(directions), rows="0 0 1\n5 1 1\n1 1 1e9", **FP))
    assert body["errors"] == {
        "editing.edits[1].layer": ["must be in [0, 1], got 5"],
        "editing.edits[1].direction": ["must hold finite numbers; bad values at indices [4]"],
        "editing.edits[2].alpha": ["must be in [-1000, 1000], got 1000000000.0"],
    }
    body = _upload(operator, _npy(np.ones((2, 8))), rows="0 0 1\n1 x", num_layers="2", num_heads="2",
                   head_dim="16").json()
    assert body["errors"] == {"rows[1]": ["must be three numbers 'layer head alpha', got '1 x'"]}
    body = _upload(operator, _npy(np.ones((2, 8))), rows="0 0 1", **FP).json()
    assert body["errors"]["rows"] == ["lists 1 row(s) of 'layer head alpha'; the file has 2 direction(s), one per row"]
    body = _upload(operator, _npy(np.ones((2, 8))), rows="0 0 1\n1 1 1", num_layers="2").json()
    assert body["errors"] == {"fingerprint.num_heads": ["is required (no live editing section to take it from)"]}
    body = _upload(operator, _npy(np.ones(8)), rows="0 0 1", **FP).json()
    assert body["errors"] == {"file": ["directions must be a 2-D array [n_edits, head_dim], got shape [8]"]}


def test_upload_refuses_pickles_and_files_that_are_not_numpy(pool, operator):
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    body = _refused(_upload(operator, SimpleUploadedFile("evil.npy", pickled.getvalue()), rows="0 0 1", **FP))
    assert list(body["errors"]) == ["file"] and "pickle" in body["errors"]["file"][0]
    body = _upload(operator, SimpleUploadedFile("edit.json", b'{"editing": {}}'), **FP).json()
    assert body["errors"] == {"file": ["edit.json is neither a .npy nor an .npz file (NumPy's formats; "
                                       "for JSON use the JSON upload)"]}
    stray = io.BytesIO()
    np.savez(stray, directions=np.ones((1, 4)), layers=np.zeros(1), heads=np.zeros(1), alphas=np.ones(1),
             extra=np.ones(1))
    body = _upload(operator, SimpleUploadedFile("x.npz", stray.getvalue()), **FP).json()
    assert body["errors"]["file"][0].startswith("unknown arrays extra")


def test_upload_needs_a_session_a_file_and_a_known_pool(pool, operator):
    assert _upload(Client(), _npy(np.ones((1, 16))), rows="0 0 1").status_code == 401
    assert _refused(operator.post(f"/ui/pools/{POOL}/editing-upload/", {"rows": "0 0 1"}))["errors"] == {
        "file": ["is required: an .npy or .npz file"]}
    assert operator.post("/ui/pools/nope/editing-upload/", {"file": _npy(np.ones((1, 16)))}).status_code == 404


def test_uploads_over_the_limit_are_refused_naming_it_with_a_retry_after(pool, operator, settings, redis_cache):
    settings.RELAYGR_UPLOAD_THROTTLE_RATE = "2/min"
    codes = [_upload(operator, _npy(np.ones((1, 16))), rows="0 0 1", **FP).status_code for _ in range(2)]
    refused = _upload(operator, _npy(np.ones((1, 16))), rows="0 0 1", **FP)
    assert codes == [200, 200] and refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 2 * 60  # the sliding window may hold it into the next minute
    assert refused.json()["detail"].startswith("Too many uploads: at most 2/min per user. Expected available in ")


def test_the_editor_offers_the_numpy_upload_to_operators_only(pool, operator, viewer):
    assert 'data-role="editing-npy-file"' in operator.get(f"/pools/{POOL}/config/").content.decode()
    assert 'data-role="editing-npy-file"' not in viewer.get(f"/pools/{POOL}/config/").content.decode()


def test_an_instance_page_is_only_for_an_instance_of_its_pool(pool, viewer):
    page = viewer.get(f"/pools/{POOL}/instances/{POOL}.3/")
    assert page.status_code == 200
    assert f'data-instance="{POOL}.3"' in page.content.decode()
    assert viewer.get(f"/pools/{POOL}/instances/other.3/").status_code == 404
