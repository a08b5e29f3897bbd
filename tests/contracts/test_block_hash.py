import subprocess
import sys

from moemesh.contracts.block_hash import HashExtra, hash_block, hash_block_chain

EXTRA = HashExtra("m", "")


def test_chain_has_one_key_per_full_block():
    assert len(hash_block_chain(list(range(10)), 4, EXTRA)) == 2
    assert hash_block_chain(list(range(3)), 4, EXTRA) == []


def test_key_depends_on_every_parent_token():
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)
    b = hash_block_chain([1, 2, 3, 9, 5, 6, 7, 8], 4, EXTRA)
    assert a[0] != b[0] and a[1] != b[1]


def test_extending_a_chain_equals_hashing_it_whole():
    tokens = list(range(100, 140))
    whole = hash_block_chain(tokens, 8, EXTRA)
    head = hash_block_chain(tokens[:16], 8, EXTRA)
    tail = hash_block_chain(tokens, 8, EXTRA, parent=head[-1], start=16)
    assert head + tail == whole


def test_keys_match_the_documented_formula():
    import hashlib
    import struct

    extra = EXTRA.encode()
    k0 = hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4) + extra).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<4q", 5, 6, 7, 8) + extra).digest()
    assert hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA) == [k0, k1]
    assert hash_block(k0, [5, 6, 7, 8], extra) == k1


def test_keys_are_identical_in_another_process():
    code = (
        "from moemesh.contracts.block_hash import HashExtra, hash_block_chain;"
        "print(hash_block_chain(list(range(64)), 16, HashExtra('m', 's'))[-1].hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == hash_block_chain(list(range(64)), 16, HashExtra("m", "s"))[-1].hex()
