"""Test-only EC connector: the project's S3ECConnector plus store faults on request.

vLLM loads it in its own engine processes through ``ec_connector_module_path`` (as any
out-of-tree connector). Before the GET of an item that has an instruction file
``$EPD_TEST_EC_FAULT_DIR/<identifier>`` (content ``delete`` or ``corrupt``), it applies that fault
to the real object in the real store, then loads as usual. The scheduler side's ``load_item``
runs only after the existence check said yes, so this is exactly "the object was deleted /
corrupted between has_cache_item's answer and the load". A ``<identifier>.done`` file records
that it fired.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.connectors.s3_ec.connector import S3ECConnector
from shared.connectors.s3_ec.scheduler import ECScheduler
from shared.store.ec import META_FINGERPRINT, META_SCHEMA
from shared.store.format import SCHEMA
from tests.vllmutil import FAULT_DIR_ENV


class FaultInjectingScheduler(ECScheduler):
    def load_item(self, identifier: str):
        fault_dir = os.environ.get(FAULT_DIR_ENV)
        instruction = Path(fault_dir) / identifier if fault_dir else None
        if instruction is not None and instruction.is_file():
            action = instruction.read_text().strip()
            instruction.unlink()
            raw = self.store.store
            key = self.store.key(identifier)
            if action == "delete":
                raw.delete(key)
            elif action == "corrupt":
                blob = bytearray(raw.get(key, max_bytes=1 << 30))
                blob[-1] ^= 0xFF  # tensor data changes, S3 metadata stays valid
                raw.put(key, bytes(blob), metadata={META_SCHEMA: SCHEMA, META_FINGERPRINT: self.store.fingerprint})
            else:
                raise ValueError(f"unknown fault {action!r}")
            instruction.with_suffix(".done").write_text(action)
        return super().load_item(identifier)


class FaultInjectingECConnector(S3ECConnector):
    scheduler_class = FaultInjectingScheduler
