"""The internal TLS settings (services/common/tls.py): one set of names in every
service's config, all three files or none, a DNS server name, clear errors for
files that are missing or hold no PEM, and the supervisor's view of them."""
from __future__ import annotations

import dataclasses

import pytest

from services.common.config import load_config
from services.common.supervisor import Chain
from services.common.tls import DEFAULT_SERVER_NAME, InternalTls, InternalTlsSettings
from services.envoy.config import EnvoyConfig
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig
from tests.tls import TestCA

SETTINGS = ("internal_tls_cert_file", "internal_tls_key_file", "internal_tls_ca_file", "internal_tls_server_name")
CONFIGS = (EdgeConfig, TokenizerConfig, SchedulerConfig, WorkerConfig, EnvoyConfig)
GRPC_CONFIGS = (TokenizerConfig, SchedulerConfig, WorkerConfig)


def env(cert="/tls/tls.crt", key="/tls/tls.key", ca="/tls/ca.crt") -> dict[str, str]:
    return {"STORMSERVE_INTERNAL_TLS_CERT_FILE": cert, "STORMSERVE_INTERNAL_TLS_KEY_FILE": key,
            "STORMSERVE_INTERNAL_TLS_CA_FILE": ca}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_service_reads_the_same_settings_off_by_default(config):
    fields = {f.name: f.default for f in dataclasses.fields(config)}
    assert {name: fields[name] for name in SETTINGS} == dict(zip(SETTINGS, ("", "", "", DEFAULT_SERVER_NAME)))
    assert InternalTls.of(load_config(config, [], {})) is None
    tls = InternalTls.of(load_config(config, [], env()))
    assert tls == InternalTls("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt", DEFAULT_SERVER_NAME)
    assert ("health_port" in fields) == (config in GRPC_CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_part_of_the_files_or_a_bad_server_name_is_refused(config):
    for partial in (env(ca=""), env(cert=""), {"STORMSERVE_INTERNAL_TLS_CA_FILE": "/tls/ca.crt"}):
        with pytest.raises(SystemExit):
            load_config(config, [], partial)
    for name in ("", "Stormserve.Internal", "-bad.example", "a..b", "10.0.0.1:443"):
        with pytest.raises(SystemExit):
            load_config(config, [], {**env(), "STORMSERVE_INTERNAL_TLS_SERVER_NAME": name})
    assert InternalTls.of(load_config(config, [], {**env(), "STORMSERVE_INTERNAL_TLS_SERVER_NAME": "a.b-c"}))


@pytest.mark.parametrize("config", GRPC_CONFIGS, ids=lambda c: c.__name__)
def test_the_health_port_is_a_port(config):
    assert load_config(config, [], {"STORMSERVE_HEALTH_PORT": "8081"}).health_port == 8081
    with pytest.raises(SystemExit):
        load_config(config, [], {"STORMSERVE_HEALTH_PORT": "70000"})


def test_a_missing_file_or_one_without_pem_is_named(tmp_path):
    ca = TestCA(tmp_path)
    pair = ca.issue_internal("service")
    (tmp_path / "empty.pem").write_text("nothing here\n")
    with pytest.raises(ValueError, match="cannot read the CA bundle .*missing.pem"):
        InternalTls(str(pair.cert), str(pair.key), str(tmp_path / "missing.pem")).channel_credentials()
    with pytest.raises(ValueError, match="private key .*empty.pem holds no PEM"):
        InternalTls(str(pair.cert), str(tmp_path / "empty.pem"), str(ca.cert)).server_credentials()
    InternalTls(str(pair.cert), str(pair.key), str(ca.cert)).client_ssl_context()


def test_the_supervisor_sees_what_its_children_see():
    assert Chain(env={}).url == "http://127.0.0.1:8000" and Chain(env={}).internal_tls is None
    chain = Chain(env=env())
    assert chain.url == "https://127.0.0.1:8000"
    assert chain.internal_tls == InternalTls.of(load_config(InternalTlsSettings, [], env()))
