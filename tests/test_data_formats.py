"""Every input format prepare_data reads: Parquet, zstd- and gzip-compressed JSON lines and text."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from jaxllm.data.corpus import ReadStats, iter_documents, list_input_files

DOCS = ["First document.\nWith two lines.", "Second one, ünïcode and all.", "Third."]


def test_parquet_zstd_gzip_inputs_read_every_document(tmp_path: Path):
    pq.write_table(pa.table({"text": DOCS, "id": [1, 2, 3]}), tmp_path / "a.parquet")
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(DOCS[0].encode()))
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "e.parquet")  # no `text` column

    stats = ReadStats()
    docs = list(iter_documents(list_input_files([tmp_path]), stats))
    by_file = {}
    for doc_id, text in docs:
        by_file.setdefault(Path(doc_id.rsplit(":", 1)[0]).name, []).append(text)
    assert by_file["a.parquet"] == DOCS
    assert by_file["b.jsonl.zst"] == DOCS
    assert by_file["c.jsonl.gz"] == DOCS
    assert by_file["d.txt.zst"] == [DOCS[0]]
    assert [s["path"].endswith("e.parquet") for s in stats.skipped_files] == [True]
    assert "text" in stats.skipped_files[0]["reason"]
