"""Model sources: content digests, publishing to a folder and to S3 (a real moto server), the
node-local cache (reuse, concurrent downloads, LRU bound), and each bad-source case with its line."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading

import boto3
import pytest

from mlpair.contracts.manifest import load_entry
from mlpair.sources import SourceUnavailable, VersionRefused, open_source
from mlpair.sources.cache import DigestCache
from mlpair.sources.digest import content_digest, files_of, pin
from mlpair.sources.publish import PublishError, publish
from tests.support.stores import SECRET

MODEL = "credit-risk"


def test_content_digest_is_the_sha256_of_the_sorted_entries():
    files = {"model.onnx": "sha256:" + "b" * 64, "a/x.json": "sha256:" + "a" * 64}
    expected = hashlib.sha256(f"a/x.json\tsha256:{'a' * 64}\nmodel.onnx\tsha256:{'b' * 64}\n".encode()).hexdigest()
    assert content_digest(files) == f"sha256:{expected}"


def test_pin_records_every_file_but_the_manifest(credit_entry, tmp_path):
    folder = shutil.copytree(credit_entry.path, tmp_path / "1")
    digest = pin(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert manifest["files"] == files_of(folder) and manifest["content_digest"] == digest
    assert load_entry(folder).manifest.content_digest == digest  # the manifest model accepts both fields


def test_publish_to_a_folder_is_atomic_idempotent_and_refuses_other_content(credit_entry, tmp_path):
    root = tmp_path / "repo"
    digest = publish(credit_entry.path, str(root))
    assert publish(credit_entry.path, f"file://{root}") == digest  # same content again: nothing changes
    published = load_entry(root / MODEL / "1")
    assert published.manifest.content_digest == digest
    assert [p.name for p in (root / MODEL).iterdir()] == ["1"]  # no staging folder left behind
    other = shutil.copytree(credit_entry.path, tmp_path / "other" / "1")
    (other / "policy-note.txt").write_text("another file: another content")
    with pytest.raises(PublishError, match=r"credit-risk version 1 already exists .* with other content"):
        publish(other, str(root))


def _s3(bucket: str, key: str):
    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def test_s3_publish_list_fetch_and_reuse_from_the_cache(credit_entry, bucket, tmp_path):
    uri = f"s3://{bucket}/prod"
    digest = publish(credit_entry.path, uri)
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(f"prod/{MODEL}/1/{p.name}" for p in credit_entry.path.iterdir())
    source = open_source(uri, tmp_path / "cache", 0)
    assert (source.models(), source.versions(MODEL), source.versions("churn")) == ([MODEL], [1], [])
    path = source.fetch(MODEL, "1")
    assert path == tmp_path / "cache" / digest.removeprefix("sha256:") / MODEL / "1"
    assert load_entry(path).manifest.model_sha256 == credit_entry.manifest.model_sha256
    # a restart (a new source on the same cache) reuses the copy: the bucket's model file is not read again
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"prod/{MODEL}/1/model.onnx")
    assert open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1") == path
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [digest.removeprefix("sha256:")]


def test_concurrent_downloads_of_one_digest_leave_one_copy(credit_entry, bucket, tmp_path):
    uri = f"s3://{bucket}/r"
    publish(credit_entry.path, uri)
    paths, errors = [], []

    def fetch() -> None:
        try:
            paths.append(open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(paths) == 4 and len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [paths[0].parent.parent.name]  # no staging left
    load_entry(paths[0])


def test_cache_evicts_the_least_recently_used_digest(tmp_path):
    cache = DigestCache(tmp_path / "c", max_bytes=2500)
    paths = {}
    for i, digest in enumerate(["sha256:" + c * 64 for c in "abc"]):
        staging = cache.staging()
        (staging / "model.onnx").write_bytes(b"x" * 1000)
        (staging / "manifest.json").write_bytes(b"{}")
        paths[digest] = cache.install(staging, digest, MODEL, str(i + 1))
        if i == 1:
            assert cache.lookup("sha256:" + "a" * 64, MODEL, "1", b"{}") is not None  # a used again: b is oldest
    assert sorted(p.name[:1] for p in cache.root.iterdir()) == ["a", "c"]


def test_corrupt_file_is_refused_with_one_line_and_never_cached(credit_entry, bucket, tmp_path):
    uri = f"s3://{bucket}/r"
    publish(credit_entry.path, uri)
    bad = b"not the published model"
    boto3.client("s3").put_object(Bucket=bucket, Key=f"r/{MODEL}/1/model.onnx", Body=bad)
    with pytest.raises(VersionRefused) as err:
        open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1")
    got = "sha256:" + hashlib.sha256(bad).hexdigest()
    assert str(err.value) == f"credit-risk version 1: file model.onnx expected {credit_entry.manifest.model_sha256} got {got}"
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_partial_upload_is_refused(credit_entry, bucket, tmp_path):
    uri = f"s3://{bucket}/r"
    publish(credit_entry.path, uri)
    whole = (credit_entry.path / "model.onnx").read_bytes()
    boto3.client("s3").put_object(Bucket=bucket, Key=f"r/{MODEL}/1/model.onnx", Body=whole[: len(whole) // 2])
    with pytest.raises(VersionRefused, match=r"^credit-risk version 1: file model.onnx expected sha256:\w{64} got sha256:\w{64}$"):
        open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1")


def test_missing_file_and_unpinned_manifest_are_refused(credit_entry, bucket, tmp_path):
    uri = f"s3://{bucket}/r"
    publish(credit_entry.path, uri)
    client = boto3.client("s3")
    client.delete_object(Bucket=bucket, Key=f"r/{MODEL}/1/preprocessing.json")
    with pytest.raises(VersionRefused) as err:
        open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1")
    assert str(err.value) == f"credit-risk version 1: file preprocessing.json is missing at s3://{bucket}/r"
    client.put_object(Bucket=bucket, Key=f"r/{MODEL}/2/manifest.json", Body=(credit_entry.path / "manifest.json").read_bytes())
    with pytest.raises(VersionRefused) as err:
        open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "2")
    assert str(err.value) == "credit-risk version 2: manifest.json has no files and content_digest; publish it with mlpair publish"


def test_unreachable_storage_is_one_line_without_credentials(monkeypatch, tmp_path, caplog):
    from tests.support.pair import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTESTNOTPRINTED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    caplog.set_level(logging.DEBUG)
    source = open_source("s3://models/r?X-Amz-Signature=abc", tmp_path / "cache", 0)
    for call in (source.models, lambda: source.versions(MODEL), lambda: source.fetch(MODEL, "1")):
        with pytest.raises(SourceUnavailable) as err:
            call()
        assert "EndpointConnectionError" in str(err.value) and str(err.value).startswith("model source s3://models/r: ")
        for text in (str(err.value), repr(err.value.__cause__), repr(err.value.__context__)):
            assert SECRET not in text and "AKIDTESTNOTPRINTED" not in text and "Signature" not in text
    assert SECRET not in caplog.text and "AKIDTESTNOTPRINTED" not in caplog.text


def test_unsupported_scheme_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^model repository gs://b/p: unsupported scheme"):
        open_source("gs://user:pw@b/p?token=1", tmp_path, 0)


def test_publish_command_publishes_the_latest_of_each_model_and_refuses_an_unknown_version(
        model_repository, tmp_path, capsys):
    from mlpair.cli import main

    target = tmp_path / "published"
    assert main(["publish", "--model-repository", str(model_repository), "--to", str(target)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"published churn version 1 to {target}", f"published credit-risk version 1 to {target}"]
    assert sorted(p.name for p in target.iterdir()) == ["churn", "credit-risk"]
    assert main(["publish", "--model-repository", str(model_repository), "--to", str(target), "--model", "churn",
                 "--version", "7"]) == 2
    assert capsys.readouterr().err == f"mlpair publish: no version 7 of 'churn' under {model_repository}; available: 1\n"


def test_a_second_process_on_the_node_reuses_the_cache(credit_entry, bucket, tmp_path):
    import subprocess
    import sys

    uri = f"s3://{bucket}/r"
    publish(credit_entry.path, uri)
    first = open_source(uri, tmp_path / "cache", 0).fetch(MODEL, "1")
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"r/{MODEL}/1/model.onnx")  # only the cache has it now
    code = ("import sys; from pathlib import Path; from mlpair.sources import open_source; "
            f"print(open_source({uri!r}, Path({str(tmp_path / 'cache')!r}), 0).fetch({MODEL!r}, '1'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(first)


def test_publishing_to_unreachable_storage_is_one_line_without_credentials(credit_entry, monkeypatch, capsys):
    from mlpair.cli import main
    from tests.support.pair import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTESTNOTPRINTED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    repo = credit_entry.path.parent.parent
    assert main(["publish", "--model-repository", str(repo), "--model", MODEL, "--to", "s3://models/p"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlpair: publish: PublishError: publishing credit-risk version 1 to s3://models/p failed "
                          "(EndpointConnectionError)")
    assert SECRET not in err and "AKID" not in err and err.count("\n") == 1
