"""CRC-32C (Castagnoli), table driven; used for the EROFS superblock checksum."""

from __future__ import annotations


def _table() -> list[int]:
    poly = 0x82F63B78
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """Standard CRC-32C of ``data`` (initial ~0, final xor ~0), continuing ``crc``."""
    crc ^= 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
