"""API keys and TLS on the client port, without a server: flag parsing, the startup checks of
the key and certificate files, key verification, and certificate re-reading.

The end-to-end behaviour (real clients against a real `serve`) is integration-tests/test_auth_tls.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from pki import Authority
from typer.testing import CliRunner

from text_generation_server.cli import main as cli
from text_generation_server.launcher import rank
from text_generation_server.launcher import supervisor as launcher
from text_generation_server.cli.client_channel import ClientOptions, client_api_key
from text_generation_server.router.metrics import Metrics
from text_generation_server.router.auth import ApiKeyError, ApiKeys, read_key_file
from text_generation_server.router.tls import CertificateStore, TlsError, TlsFiles, load_tls
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.settings.serve_flags import TGI_ONLY_FLAGS, is_loopback, parse_api_keys

SECURITY_VARIABLES = ("API_KEY", "API_KEY_FILE", "API_KEY_PROTECTS_HEALTH", "TLS_CERT_PATH", "TLS_KEY_PATH",
                      "TLS_CLIENT_CA_PATH", "METRICS_HOSTNAME")


@pytest.fixture
def serve(monkeypatch):
    """serve(*argv, **env) -> (exit code, output, ServeArgs or None, warnings), `launch` recorded, not run."""
    for name in cli.serve_environment_variables():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(rank.SERVE_ARGS_ENV, raising=False)
    seen: dict = {}

    def fake_launch(args, startup_timeout_s=600.0, warnings=()):
        seen["args"], seen["warnings"] = args, list(warnings)
        return 0

    monkeypatch.setattr(launcher, "launch", fake_launch)

    def run(*argv: str, **env: str):
        seen.clear()
        result = CliRunner().invoke(cli.app, ["serve", *argv], env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.output, seen.get("args"), seen.get("warnings", [])

    return run


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Files of a CA, a server certificate it signed, another server's key, and a client CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other, clients = Authority("test CA"), Authority("other CA"), Authority("client CA")
    (folder / "ca.crt").write_bytes(ca.cert)
    (folder / "clients.crt").write_bytes(clients.cert)
    server_cert, server_key = ca.issue("server").write(folder, "server")
    _, other_key = other.issue("other").write(folder, "other")
    encrypted = ca.issue("locked", password=b"secret")
    _, locked_key = encrypted.write(folder, "locked")
    (folder / "locked.crt").write_bytes(encrypted.cert)
    return {"folder": folder, "cert": str(server_cert), "key": str(server_key), "other_key": str(other_key),
            "locked_cert": str(folder / "locked.crt"), "locked_key": str(locked_key),
            "ca": str(folder / "ca.crt"), "clients": str(folder / "clients.crt"), "authority": ca}


# -- flags -----------------------------------------------------------------------------------------------
def test_api_key_is_no_longer_a_refused_tgi_flag():
    assert "api_key" not in {flag.name for flag in TGI_ONLY_FLAGS}


def test_api_keys_from_flags_and_the_environment(serve):
    code, output, args, _ = serve("--api-key", "k1", "--api-key", "k2,k3")
    assert code == 0, output
    assert args.api_keys == ["k1", "k2", "k3"]
    code, output, args, _ = serve(API_KEY="tgi-key")  # TGI's variable, one key
    assert code == 0, output
    assert args.api_keys == ["tgi-key"] and args.requires_api_key
    code, output, args, _ = serve(API_KEY="old-key, new-key")  # rotation: comma-separated
    assert args.api_keys == ["old-key", "new-key"]
    code, output, args, _ = serve("--api-key", "flag-key", API_KEY="env-key")  # the command line wins
    assert args.api_keys == ["flag-key"]


def test_every_security_setting_reads_its_variable(serve, pki, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n")
    code, output, args, _ = serve(
        API_KEY="k", API_KEY_FILE=str(key_file), API_KEY_PROTECTS_HEALTH="true", TLS_CERT_PATH=pki["cert"],
        TLS_KEY_PATH=pki["key"], TLS_CLIENT_CA_PATH=pki["clients"], METRICS_HOSTNAME="0.0.0.0")
    assert code == 0, output
    assert (args.api_keys, args.api_key_file, args.api_key_protects_health) == (["k"], str(key_file), True)
    assert (args.tls_cert_path, args.tls_key_path, args.tls_client_ca_path) == (pki["cert"], pki["key"],
                                                                                pki["clients"])
    assert (args.metrics_hostname, args.effective_metrics_hostname) == ("0.0.0.0", "0.0.0.0")
    assert set(SECURITY_VARIABLES) <= set(cli.serve_environment_variables())


def test_metrics_bind_beside_the_client_api_by_default(serve):
    _, _, args, _ = serve("--hostname", "10.1.2.3")
    assert (args.metrics_hostname, args.effective_metrics_hostname) == (None, "10.1.2.3")
    _, _, args, _ = serve("--hostname", "0.0.0.0", "--metrics-hostname", "127.0.0.1")
    assert args.effective_metrics_hostname == "127.0.0.1"


@pytest.mark.parametrize("values, message", [
    (["has space"], "printable ASCII"),
    (["tab\there"], "printable ASCII"),
    (["caf\u00e9"], "printable ASCII"),
    ([","], "no API key"),
    ([" , "], "no API key"),
])
def test_unusable_api_keys_are_refused_without_quoting_them(values, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_api_keys(values, "--api-key")
    assert "--api-key" in str(err.value)
    for value in values:
        if value.strip(" ,"):
            assert value not in str(err.value)


def test_bad_api_key_flag_exits_2_naming_the_variable(serve):
    code, output, args, _ = serve(API_KEY="two words")
    assert code == 2 and args is None
    assert "environment variable API_KEY" in output and "two words" not in output


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("", "holds no key"),
    ("\n# only a comment\n   \n", "holds no key"),
    ("good\nbad key\n", "line 2"),
])
def test_key_file_missing_empty_or_bad_is_a_startup_error(serve, tmp_path, content, message):
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    code, output, args, _ = serve("--api-key-file", str(path))
    assert code == 2 and args is None, output
    assert f"--api-key-file {path}" in output and message in output
    assert "bad key" not in output


def test_key_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated 2025-01\nnew-key\n\n  old-key  \n")
    assert read_key_file(str(path)) == ["new-key", "old-key"]


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert-path", "c.pem"], "--tls-key-path is missing"),
    (["--tls-key-path", "k.pem"], "--tls-cert-path is missing"),
    (["--tls-client-ca-path", "ca.pem"], "--tls-client-ca-path needs --tls-cert-path"),
    (["--api-key-protects-health"], "--api-key-protects-health needs --api-key"),
])
def test_incomplete_security_flags_are_refused(serve, argv, message):
    code, output, args, _ = serve(*argv)
    assert code == 2 and args is None
    assert message in output


def test_bad_certificate_files_are_startup_errors_naming_the_file(serve, pki, tmp_path):
    missing = str(tmp_path / "nowhere.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    cases = [
        (["--tls-cert-path", missing, "--tls-key-path", pki["key"]], f"--tls-cert-path {missing}: cannot read it"),
        (["--tls-cert-path", pki["cert"], "--tls-key-path", missing], f"--tls-key-path {missing}: cannot read it"),
        (["--tls-cert-path", str(garbage), "--tls-key-path", pki["key"]],
         f"--tls-cert-path {garbage}: not a valid PEM certificate"),
        (["--tls-cert-path", pki["key"], "--tls-key-path", pki["key"]], "no PEM certificate in it"),
        (["--tls-cert-path", pki["cert"], "--tls-key-path", pki["cert"]], "no PEM private key in it"),
        (["--tls-cert-path", pki["cert"], "--tls-key-path", pki["other_key"]],
         f"--tls-key-path {pki['other_key']} is not the key of the certificate in --tls-cert-path {pki['cert']}"),
        (["--tls-cert-path", pki["locked_cert"], "--tls-key-path", pki["locked_key"]], "the key is encrypted"),
        (["--tls-cert-path", pki["cert"], "--tls-key-path", pki["key"], "--tls-client-ca-path", missing],
         f"--tls-client-ca-path {missing}: cannot read it"),
        (["--tls-cert-path", pki["cert"], "--tls-key-path", pki["key"], "--tls-client-ca-path", pki["key"]],
         "--tls-client-ca-path"),
    ]
    for argv, message in cases:
        code, output, args, _ = serve(*argv)
        assert code == 2 and args is None, (argv, output)
        assert message in " ".join(output.split()), (argv, output)


def test_good_tls_files_start_and_keys_without_tls_off_loopback_warn(serve, pki):
    code, output, _, warnings = serve("--tls-cert-path", pki["cert"], "--tls-key-path", pki["key"],
                                      "--tls-client-ca-path", pki["clients"], "--hostname", "0.0.0.0",
                                      "--api-key", "k")
    assert code == 0, output
    assert warnings == []
    _, _, _, warnings = serve("--hostname", "0.0.0.0", "--api-key", "k")
    assert len(warnings) == 1 and "plaintext" in warnings[0] and "--tls-cert-path" in warnings[0]
    _, _, _, warnings = serve("--api-key", "k")  # loopback: nothing crosses a network
    assert warnings == []


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "::1", "[::1]", "localhost", "127.5.0.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))


def test_keys_stay_out_of_repr_and_of_the_ranks_copy():
    args = ServeArgs(api_keys=["s3cret"], api_key_file="/run/keys")
    assert "s3cret" not in repr(args)
    sent = ServeArgs.from_json(args.to_json())
    assert sent.api_keys == [] and "s3cret" not in args.to_json()
    assert sent == dataclasses.replace(args, api_keys=[])


# -- verification ----------------------------------------------------------------------------------------
def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_verify_missing_wrong_and_right_keys():
    keys = ApiKeys(["alpha", "beta"])
    assert len(keys) == 2
    assert keys.verify(None) == "missing"
    assert keys.verify((("x-other", "alpha"),)) == "missing"
    assert keys.verify(bearer("gamma")) == "invalid"
    assert keys.verify(bearer("alph")) == "invalid"
    assert keys.verify((("authorization", "Basic alpha"),)) == "invalid"
    assert keys.verify((("authorization", "Bearer "),)) == "invalid"
    assert keys.verify((("authorization", "alpha"),)) == "invalid"
    assert keys.verify(bearer("alpha")) is None and keys.verify(bearer("beta")) is None
    assert keys.verify((("authorization", "bearer alpha"),)) is None  # the scheme is case-insensitive
    assert keys.verify((("authorization", b"Bearer beta"),)) is None


def test_no_keys_at_all_is_refused():
    with pytest.raises(ApiKeyError):
        ApiKeys([])


def test_key_file_rotation_and_a_broken_rewrite_keeps_the_old_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("first\n")
    keys = ApiKeys(["fixed"], str(path))
    assert keys.verify(bearer("first")) is None
    path.write_text("first\nsecond\n")
    assert keys.verify(bearer("second")) is None  # re-read on its own when the file changed
    path.write_text("")  # a rewrite caught half way: neither lock everyone out nor open up
    assert not keys.refresh()
    assert keys.verify(bearer("second")) is None and keys.verify(bearer("fixed")) is None
    path.unlink()
    assert keys.verify(bearer("first")) is None
    path.write_text("third\n")
    assert keys.verify(bearer("third")) is None and keys.verify(bearer("first")) == "invalid"
    assert keys.verify(bearer("fixed")) is None


def test_unauthenticated_metric_starts_at_zero_with_both_reasons():
    text = Metrics(model_name="m").render().decode()
    for reason in ("missing", "invalid"):
        assert f'tgs_request_unauthenticated{{model_name="m",reason="{reason}"}} 0.0' in text
        assert f'tgs_request_unauthenticated_total{{model_name="m",reason="{reason}"}} 0.0' in text


# -- certificates ----------------------------------------------------------------------------------------
def test_certificate_store_serves_a_rotated_pair_once_and_keeps_serving_on_a_bad_one(pki, tmp_path):
    authority = pki["authority"]
    cert, key = authority.issue("first").write(tmp_path, "live")
    store = CertificateStore(TlsFiles(str(cert), str(key)))
    assert not store.mutual
    first = store.material.fingerprint
    assert store.fetch() is None  # nothing changed
    assert not store.refresh(force=True)  # re-read, same files

    rotated = authority.issue("second")
    cert.write_bytes(rotated.cert)
    assert store.fetch() is None  # only the certificate so far: its key does not match; keep serving
    assert store.material.fingerprint == first
    key.write_bytes(rotated.key)
    assert store.fetch() is not None  # the pair is whole again: handed to gRPC once
    assert store.fetch() is None
    assert store.material.fingerprint != first and store.material.cert_chain == rotated.cert

    cert.write_text("garbage")
    assert store.fetch() is None and store.material.cert_chain == rotated.cert
    assert not store.refresh(force=True)


def test_load_tls_reads_a_client_ca(pki):
    material = load_tls(TlsFiles(pki["cert"], pki["key"], pki["clients"]))
    assert material.client_ca == Path(pki["clients"]).read_bytes()
    assert len(material.fingerprint.split(":")) == 32


def test_fingerprint_is_the_leafs_in_a_chain(pki, tmp_path):
    leaf = load_tls(TlsFiles(pki["cert"], pki["key"]))
    chain = tmp_path / "chain.crt"
    chain.write_bytes(Path(pki["cert"]).read_bytes() + Path(pki["ca"]).read_bytes())
    assert load_tls(TlsFiles(str(chain), pki["key"])).fingerprint == leaf.fingerprint


def test_load_tls_errors_are_tls_errors(pki, tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_text("  \n")
    with pytest.raises(TlsError, match="the file is empty"):
        load_tls(TlsFiles(str(empty), pki["key"]))


# -- the client side ---------------------------------------------------------------------------------------
def test_client_options(tmp_path, pki):
    assert not ClientOptions().uses_tls and ClientOptions().metadata == ()
    assert ClientOptions(tls=True).uses_tls and ClientOptions(ca_path=pki["ca"]).uses_tls
    assert ClientOptions(api_key="k").metadata == (("authorization", "Bearer k"),)
    with pytest.raises(ValueError, match="go together"):
        ClientOptions(cert_path=pki["cert"])
    with pytest.raises(ValueError, match="--api-key"):
        ClientOptions(api_key="a b")
    with pytest.raises(ValueError, match="--tls-ca-path"):
        ClientOptions(ca_path=str(tmp_path / "missing")).channel("127.0.0.1:1")
    path = tmp_path / "keys"
    path.write_text("# comment\nfirst\nsecond\n")
    assert client_api_key(None, str(path)) == "first"
    assert client_api_key("a,b", str(path)) == "a"
    assert client_api_key(None, None) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        client_api_key(None, str(path))
    assert os.path.exists(pki["ca"])
