"""Which store a URL names and how its client is configured, without a store: the table of
clouds, their bucket rules, the reader table's rows, the emulator and connection-string
settings each cloud reads from the environment."""

from __future__ import annotations

import pytest

from batchd_server.storage.azure import connection_settings
from batchd_server.storage.clouds import CLOUDS, cloud_of, is_object_url, split_url, store_of
from batchd_server.storage.gcs import emulator_url
from batchd_server.storage.objects import ObjectFiles
from batchd_server.storage.open import READERS, open_reader
from batchd_server.storage.schemes import is_local_root


def test_each_store_is_a_row_of_the_reader_table_and_of_the_cloud_table() -> None:
    """s3://, gs:// and az:// roots open an object-store reader (no request is made to open
    one); the clouds' table and the readers' agree."""
    assert set(CLOUDS) == {"s3", "gs", "az"}
    assert set(READERS) == {"", *CLOUDS}
    for scheme in CLOUDS:
        root = f"{scheme}://data/prefix"
        assert is_object_url(root) and not is_local_root(root)
        reader = open_reader(root)
        assert isinstance(reader, ObjectFiles)
        reader.close()
    assert not is_object_url("/data/x") and not is_object_url("hdfs://data/x")


@pytest.mark.parametrize(
    ("url", "parts"),
    [
        ("gs://my_bucket.v2/a/b", ("my_bucket.v2", "a/b")),
        ("az://my-container/a/b.tar", ("my-container", "a/b.tar")),
        ("GS://data/x", ("data", "x")),
        ("az://data", ("data", "")),
    ],
)
def test_a_cloud_url_splits_into_bucket_and_key(url: str, parts: tuple[str, str]) -> None:
    assert split_url(url) == parts


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs:///x", "names no bucket; write gs://BUCKET/PREFIX"),
        ("az:///x", "names no container; write az://CONTAINER/PREFIX"),
        ("gs://Data/x", "is not a valid bucket name"),
        ("gs://10.0.0.1/x", "is not a valid bucket name"),
        ("az://a_b/x", "is not a valid container name"),
        ("az://a--b/x", "is not a valid container name"),
        ("az://ab/x", "is not a valid container name"),
        ("az://" + "x" * 64 + "/x", "is not a valid container name"),
        ("s3://a_b/x", "is not a valid bucket name"),
        ("hdfs://data/x", "is not an object-store URL (s3://, gs://, az://)"),
    ],
)
def test_an_invalid_cloud_url_is_a_clear_error_before_any_request(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_url(url)


def test_the_gcs_emulator_is_found_by_storage_emulator_host() -> None:
    """As Google's own clients do: host:port means plain HTTP; a URL is taken as is."""
    assert emulator_url({}) is None
    assert emulator_url({"STORAGE_EMULATOR_HOST": "localhost:4443"}) == "http://localhost:4443"
    assert emulator_url({"STORAGE_EMULATOR_HOST": "https://gcs.test/"}) == "https://gcs.test"
    assert cloud_of("gs://b/x").endpoint({"STORAGE_EMULATOR_HOST": "h:1"}) == "http://h:1"


def test_an_azure_connection_string_gives_the_account_its_credential_and_endpoint() -> None:
    """Account key, SAS, endpoint and the development-storage shortcut are read from
    AZURE_STORAGE_CONNECTION_STRING; an explicit AZURE_STORAGE_ACCOUNT_NAME wins over it."""
    text = (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5PQ==;"
        "EndpointSuffix=core.windows.net"
    )
    env = {"AZURE_STORAGE_CONNECTION_STRING": text}
    assert connection_settings(env) == {"account_name": "acct", "access_key": "a2V5PQ=="}
    sas = "BlobEndpoint=http://127.0.0.1:1/acct/;SharedAccessSignature=?sv=1&sig=x%3D"
    assert connection_settings({"AZURE_STORAGE_CONNECTION_STRING": sas}) == {
        "sas_key": "sv=1&sig=x%3D",
        "endpoint": "http://127.0.0.1:1/acct",
    }
    assert connection_settings({"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"})[
        "use_emulator"
    ]
    assert connection_settings({**env, "AZURE_STORAGE_ACCOUNT_NAME": "other"}) == {}
    azure = cloud_of("az://c/x")
    assert azure.endpoint({"AZURE_STORAGE_CONNECTION_STRING": sas}) == "http://127.0.0.1:1/acct"
    assert azure.endpoint({"AZURE_STORAGE_USE_EMULATOR": "true"}) == "http://127.0.0.1:10000"


def test_a_client_is_made_once_per_process_bucket_and_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same bucket twice is one client; a changed store variable makes a new one."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
    first, key = store_of("gs://data/a/b", retry_s=0.5)
    assert key == "a/b" and store_of("gs://data/c", retry_s=0.5)[0] is first
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:10")
    assert store_of("gs://data/c", retry_s=0.5)[0] is not first
