from store.block_hash import block_hashes, block_key, from_wire, root_hash, to_wire


def test_chained_hash_names_the_whole_prefix():
    a = list(range(100))
    b = list(range(64)) + [999] + list(range(65, 100))
    ha, hb = block_hashes(a, 32), block_hashes(b, 32)
    assert len(ha) == 3  # the trailing partial block has no hash
    assert ha[:2] == hb[:2]  # same first 64 tokens
    assert ha[2] != hb[2]


def test_a_block_hash_depends_on_everything_before_it():
    x = [1] * 32
    assert block_hashes([2] * 32 + x, 32)[1] != block_hashes([3] * 32 + x, 32)[1]


def test_salt_separates_tenants_and_is_deterministic():
    toks = list(range(64))
    assert block_hashes(toks, 32, "a") != block_hashes(toks, 32, "b")
    assert block_hashes(toks, 32, "a") == block_hashes(toks, 32, "a")
    assert block_hashes(toks, 32, None) == block_hashes(toks, 32, "")
    assert root_hash("a") != root_hash(None)


def test_known_value_is_stable_across_processes():
    # Pool keys outlive processes: the scheme must not depend on Python's hash seed.
    assert block_hashes(list(range(32)), 32) == block_hashes(list(range(32)), 32)
    assert block_key("ns", 255) == "ns/" + "0" * 30 + "ff"
    assert block_hashes(list(range(32)), 32)[0] == 0x5635E120543FAAB6F8AC95C12E3F6454


def test_hashes_are_128_bits_and_cross_the_wire_unchanged():
    hashes = block_hashes(list(range(320)), 32)
    assert max(hashes).bit_length() > 64  # not a 64-bit hash widened
    assert all(h < 1 << 128 for h in hashes)
    assert from_wire(to_wire(hashes)) == hashes
    assert all(len(b) == 16 for b in to_wire(hashes))


def test_short_and_empty_prompts():
    assert block_hashes([], 32) == []
    assert block_hashes([1, 2, 3], 32) == []
