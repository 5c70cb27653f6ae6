"""Writes megaloop/codegen/include/megaloop/abi.cuh from the ABI's description (megaloop/codegen/abi.py);
tests/test_abi.py checks the header is current.

    python scripts/gen_abi.py
"""

from __future__ import annotations

from megaloop.codegen import abi

if __name__ == "__main__":
    abi.HEADER.write_text(abi.render())
    print(f"wrote {abi.HEADER}")
