"""``records.jsonl``: the benchmark's one record per finished run, kept as the run goes (resumable)."""

from __future__ import annotations

import json
from pathlib import Path

RECORDS_FILE = "records.jsonl"


class RecordStore:
    """``records.jsonl`` in the output directory: one JSON object per finished run, appended as it ends.

    Records carry the run's settings id; a rerun with equal settings skips what is there.
    """

    def __init__(self, directory: Path, settings_id: str) -> None:
        self.path = directory / RECORDS_FILE
        self.settings_id = settings_id
        self.records: list[dict] = []
        self.ignored = 0
        if self.path.exists():
            text = self.path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):  # a run killed mid-write: drop its partial last line
                text = text[: text.rfind("\n") + 1]
                self.path.write_text(text, encoding="utf-8")
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a corrupt line: skip it (its run is redone)
                    continue
                if rec.get("settings_id") == settings_id:
                    self.records.append(rec)
                else:
                    self.ignored += 1
        self._done = {self._key(r) for r in self.records}

    @staticmethod
    def _key(r: dict) -> tuple:
        return r["kind"], r.get("variant"), r.get("prompt"), r.get("model"), r.get("rep", 0)

    def has(self, kind: str, variant: str | None = None, prompt: str | None = None, model: str | None = None,
            rep: int = 0) -> bool:
        return (kind, variant, prompt, model, rep) in self._done

    def add(self, record: dict) -> None:
        record = {"settings_id": self.settings_id, **record}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
        self.records.append(record)
        self._done.add(self._key(record))

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]
