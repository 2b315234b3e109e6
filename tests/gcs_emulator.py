"""Runs gcp-storage-emulator (a real GCS JSON-API server) for the tests, with two upstream gaps filled that
tensorstore (orbax's array writer) runs into: an upload with an empty body reaches its handler as None and fails
with a 500, and downloads lack the `x-goog-generation` header that tensorstore reads the object's generation from.

    python tests/gcs_emulator.py start --host 127.0.0.1 --port 9023 --default-bucket b --in-memory -q
"""

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status < 300:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download  # before server.py builds its routing table from it

from gcp_storage_emulator import server  # noqa: E402
from gcp_storage_emulator.__main__ import main  # noqa: E402

_data = server.Request.data.fget
server.Request.data = property(lambda self: b"" if (d := _data(self)) is None else d)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
