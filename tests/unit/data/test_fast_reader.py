"""The block readers (data.fast_tsv, data.fast_jsonl) against the line parsers they stand in for: the same arrays
bit for bit, the same bad line named, the same bad rows skipped and counted; a byte order mark and a blank last line
read as if absent."""

import gzip
import json
import shutil

import numpy as np
import pytest

import bagpipe.data.fast_jsonl as fast_jsonl
import bagpipe.data.fast_tsv as fast_tsv
import bagpipe.data.preprocess as pre
from bagpipe.data.avazu import COLUMNS
from bagpipe.data.formats import CriteoParser, DataError, JsonlParser, TextBlock
from bagpipe.data.preprocess import preprocess
from bagpipe.synth import generate

SIZES = [7, 1000, 2**31 - 1, 3]
DENSE = ["", "0", "-0", "-1", "7", "0007", "-42", "999999999999999", "-99999999999999", "450359962737049"]
ODD_DENSE = ["1.5", "+3", "1e3", " 4", "12345678901234567890", "-0.0"]  # valid, but only for the line parser


def hex_token(rng, digits):
    return "".join(rng.choice(list("0123456789abcdefABCDEF"), digits))


def criteo_rows(rng, count, *, odd=False):
    """Rows with empty fields, zero, negative and large integers, hex of 1 to 16 digits in either case; ``odd``:
    also values that only the line parser reads (a label 1.0, the dense values above, hex of 17 or more digits)."""
    rows = []
    for _ in range(count):
        label = rng.choice(["0", "1", "1.0"] if odd else ["0", "1"])
        dense = rng.choice(DENSE + ODD_DENSE if odd else DENSE, 13)
        cats = [hex_token(rng, int(rng.integers(0, 21 if odd else 17))) if rng.random() < 0.8 else ""
                for _ in SIZES]
        rows.append("\t".join([label, *dense, *cats]))
    return rows


def reference(parser, data: bytes, method="parse_lines"):
    """``parser`` as it was before the block readers: decoded lines, parsed in Python."""
    (first, lines), = TextBlock.of(data).decoded(path="f", first_line=1, bad=None)
    return getattr(parser, method)(lines, path="f", first_line=first, bad=None)


def assert_same(a, b, names=("labels", "dense", "ids")):
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


@pytest.fixture
def line_parsers_refused(monkeypatch):
    """Fail a test whose block falls back to the line parsers: the block reader must read it all."""
    def refused(*args, **kwargs):
        raise AssertionError("the block reader gave this block to the line parser")

    for name in ("parse_lines", "tokens_lines"):
        monkeypatch.setattr(CriteoParser, name, refused)
    monkeypatch.setattr(JsonlParser, "parse_lines", refused)


@pytest.fixture
def small_chunks(monkeypatch):
    """Blocks of a few hundred bytes, read in several pieces each: every boundary is crossed."""
    monkeypatch.setattr(pre, "BYTES_PER_CHUNK", 700)
    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 9)
    monkeypatch.setattr(fast_tsv, "MIN_PIECE_BYTES", 100)


def line_parsers_only(monkeypatch):
    monkeypatch.setattr(fast_tsv, "separate", lambda *args, **kwargs: None)
    monkeypatch.setattr(fast_tsv, "split_fields", lambda *args, **kwargs: None)
    monkeypatch.setattr(fast_jsonl, "one_hot_rows", lambda *args, **kwargs: None)


def converted(tmp_path, monkeypatch, source, name, **kwargs):
    """The files ``preprocess`` writes for ``source``, by the block readers and by the line parsers alone."""
    outputs = []
    for kind in ("blocks", "lines"):
        with monkeypatch.context() as patch:
            if kind == "lines":
                line_parsers_only(patch)
            meta = preprocess(source, tmp_path / f"{name}-{kind}", show_progress=False, **kwargs)
        files = {p.relative_to(tmp_path / f"{name}-{kind}"): p.read_bytes()
                 for p in sorted((tmp_path / f"{name}-{kind}").rglob("*")) if p.is_file()}
        outputs.append((meta, files))
    return outputs


def test_plain_criteo_blocks_are_read_whole_and_equal_the_line_parser(line_parsers_refused):
    rng = np.random.default_rng(0)
    data = "".join(row + "\n" for row in criteo_rows(rng, 3000)).encode()
    parser = CriteoParser(SIZES)
    chunk = parser.parse(TextBlock.of(data), path="f", first_line=1, bad=None)
    assert len(chunk.labels) == 3000
    crlf = parser.parse(TextBlock.of(data.replace(b"\n", b"\r\n")), path="f", first_line=1, bad=None)
    assert_same(crlf, chunk)
    tokens = CriteoParser(num_tables=len(SIZES)).tokens(TextBlock.of(data), path="f", first_line=1, bad=None)
    assert all(isinstance(column, np.ndarray) for column in tokens.columns)


def test_criteo_blocks_equal_the_line_parser_bit_for_bit():
    rng = np.random.default_rng(1)
    for odd in (False, True):
        data = "".join(row + "\n" for row in criteo_rows(rng, 2000, odd=odd)).encode()
        for text in (data, data.replace(b"\n", b"\r\n"), data[:-1]):  # and a last line without its newline
            parser = CriteoParser(SIZES)
            assert_same(parser.parse(TextBlock.of(text), path="f", first_line=1, bad=None), reference(parser, text))
            base = CriteoParser(num_tables=len(SIZES))
            new = base.tokens(TextBlock.of(text), path="f", first_line=1, bad=None)
            old = reference(base, text, "tokens_lines")
            assert_same(new, old, names=("labels", "dense"))
            assert [list(column) for column in new.columns] == [list(column) for column in old.columns]


@pytest.mark.parametrize("text", ["+5", "1.5", "1e3", " 5", "5 ", "\u0663", "-", "--1", "1-", "0x1f", "1_000",
                                  "1234567890123456"])
def test_decimals_outside_the_grammar_are_left_to_the_line_parser(text):
    row = "\t".join(["1", text, *["1"] * 12, "a", "b", "c", "d"])
    fields = fast_tsv.split_fields(row.encode(), num_columns=18, delimiter="\t")
    assert fields is None or fast_tsv.decimals(fields[1]) is None


def test_decimals_equal_python_float():
    texts = ["0", "-0", "00", "-007", "123456789012345", "-12345678901234", "9007199254740993"[:15], ""]
    fields = fast_tsv.split_fields("\n".join(texts).encode() + b"\n", num_columns=1, delimiter="\t")
    values = fast_tsv.decimals(fields[0])
    expected = np.array([float(text) if text else 0.0 for text in texts])
    assert values.tobytes() == expected.tobytes()  # -0.0 too


@pytest.mark.parametrize("data", [b"\xef\xbb\xbf1\ta\n", b"1\ta\r\n0\tb\rc\n", b"1\ta\n\n0\tb\n", b"1\ta\r\r\n",
                                  b"1\ta\tb\n", b'1\t"a\tb"\n'])
def test_what_pyarrow_would_split_otherwise_is_refused(data):
    assert fast_tsv.split_fields(data, num_columns=2, delimiter="\t") is None


@pytest.mark.parametrize("text", ["0x12", "g", "12345678901234567", " a", "a\u00e9"])
def test_hex_outside_the_grammar_is_left_to_the_line_parser(text):
    fields = fast_tsv.split_fields(f"{text}\n".encode(), num_columns=1, delimiter="\t")
    assert fast_tsv.hex_values(fields[0]) is None


def published_rows(rng, count):
    """Criteo as published: labels 0 or 1, decimals of at most 8 digits (and a sign), hex of 8 digits or empty; the
    last row's last field empty, so that a field starts in a block's last bytes."""
    dense = ["", "0", "-0", "-1", "7", "00000007", "-99999999", "12345678", "-12345678", "99999999"]
    rows = [
        "\t".join([str(rng.integers(0, 2)),
                   *[rng.choice(dense) if rng.random() < 0.3 else str(rng.integers(0, 10 ** int(rng.integers(1, 9))))
                     for _ in range(13)],
                   *[hex_token(rng, 8) if rng.random() < 0.8 else "" for _ in SIZES]])
        for _ in range(count)]
    return rows[:-1] + [rows[-1][:rows[-1].rindex("\t") + 1]]


def test_criteo_as_published_is_read_by_numpy_alone_and_equals_the_line_parser(monkeypatch):
    data = "".join(row + "\n" for row in published_rows(np.random.default_rng(11), 3000)).encode()
    expected = reference(CriteoParser(SIZES), data)

    def refused(*args, **kwargs):
        raise AssertionError("the fixed-width reader gave this block to another reader")

    for name in ("parse_lines", "_piece_fields"):
        monkeypatch.setattr(CriteoParser, name, refused)
    monkeypatch.setattr(fast_tsv, "MIN_PIECE_BYTES", 1000)  # many pieces, each with a last line of its own
    parser = CriteoParser(SIZES)
    assert_same(parser.parse(TextBlock.of(data), path="f", first_line=1, bad=None), expected)
    assert parser.fixed_widths


@pytest.mark.parametrize("column, text", [
    (1, "123456789"), (1, "-123456789"), (1, "-"), (1, "--1"), (1, "+5"), (1, "1-"), (1, "1:"), (1, "/"), (1, " 1"),
    (14, "1234567"), (14, "123456789"), (14, "0000000g"), (14, "0000000:"), (14, "@bcdef01"), (14, "\u00e9bcdef0"),
    (0, "2"), (0, "00"), (0, ""), (0, "1.0")])
def test_fields_outside_the_fixed_widths_go_to_the_general_readers_with_the_same_result(column, text):
    rows = [row.split("\t") for row in published_rows(np.random.default_rng(12), 40)]
    rows[17][column] = text
    data = "".join("\t".join(row) + "\n" for row in rows).encode()
    parser = CriteoParser(SIZES)
    assert parser._fixed_width_piece(memoryview(data)) is None
    try:
        expected = reference(CriteoParser(SIZES), data)
    except DataError as err:
        with pytest.raises(DataError) as raised:
            parser.parse(TextBlock.of(data), path="f", first_line=1, bad=None)
        assert str(raised.value) == str(err)
    else:
        assert_same(parser.parse(TextBlock.of(data), path="f", first_line=1, bad=None), expected)
    assert not parser.fixed_widths  # and later blocks go straight to the general readers


def test_fixed_width_readers_equal_python_on_random_values():
    rng = np.random.default_rng(13)
    numbers = rng.integers(-99_999_999, 100_000_000, 20_000)
    decimals = [f"{'-' if n < 0 else ''}{abs(n):0{int(rng.integers(1, 9))}d}" for n in numbers] + ["-0", "", "0"]
    hexes = ["".join(c.upper() if rng.random() < 0.5 else c for c in f"{v:08x}")
             for v in rng.integers(0, 2**32, len(decimals))]
    hexes[-2] = ""
    data = "".join(f"1\t{d}\t{h}\n" for d, h in zip(decimals, hexes)).encode()
    split = fast_tsv.separate(data, num_columns=3, delimiter="\t")
    values = fast_tsv.short_decimals(split, slice(1, 2))[:, 0]
    assert values.tobytes() == np.array([float(d) if d else 0.0 for d in decimals]).tobytes()  # -0.0 too
    assert fast_tsv.hex8_values(split, slice(2, 3))[:, 0].tolist() == [int(h or "0", 16) for h in hexes]


def test_fields_in_a_blocks_last_bytes_are_read_whole():
    split = fast_tsv.separate(b"1\t00000001\t12\n0\tABCDEF12\t-7654\n", num_columns=3, delimiter="\t")
    assert fast_tsv.short_decimals(split, slice(2, 3))[:, 0].tolist() == [12.0, -7654.0]
    assert fast_tsv.hex8_values(split, slice(1, 2))[:, 0].tolist() == [1, 0xABCDEF12]


@pytest.mark.parametrize("data", [b"1\ta\tb\n0\tc\td", b"1\ta\tb\r\n0\tc\td\n", b"1\ta\tb\n\n0\tc\td\n",
                                  b"1\ta\tb\n0\tc\n1\td\te\tf\n", b"1\ta\tb\n0\tc\td\te\n", b"1\t\t\n"])
def test_what_numpy_alone_does_not_split_is_refused(data):
    assert fast_tsv.separate(data, num_columns=3, delimiter="\t") is None


def test_conversions_of_synth_data_and_varied_rows_are_byte_for_byte_the_same(tmp_path, monkeypatch, small_chunks):
    synth = tmp_path / "synth"
    generate(synth, rows=3000, test_rows=500, seed=2, table_sizes=[5, 100, 10_000], show_progress=False)
    (blocks_meta, blocks), (lines_meta, lines) = converted(tmp_path, monkeypatch, synth, "synth")
    assert blocks == lines and blocks_meta["rows"] == {"train": 3000, "test": 500}

    rng = np.random.default_rng(3)
    varied = tmp_path / "varied"
    varied.mkdir()
    (varied / "train.tsv.gz").write_bytes(gzip.compress("".join(r + "\n" for r in criteo_rows(rng, 1500)).encode()))
    (varied / "meta.json").write_text(json.dumps({"table_sizes": SIZES}))
    (blocks_meta, blocks), (_, lines) = converted(tmp_path, monkeypatch, varied, "varied")
    assert blocks == lines and blocks_meta["held_out"]["from_line"] == 1500 - round(1500 / 7) + 1
    (_, blocks), (_, lines) = converted(tmp_path, monkeypatch, varied, "vocab", vocab_min_count=2)
    assert blocks == lines and any(name.parts[0] == "vocab" for name in blocks)


def test_lines_longer_than_a_block_and_blocks_cut_at_their_line_count(tmp_path, monkeypatch):
    monkeypatch.setattr(pre, "BYTES_PER_CHUNK", 40)  # every line is longer
    source = write_rows(tmp_path / "train.tsv", criteo_rows(np.random.default_rng(8), 50))
    (_, blocks), (_, lines) = converted(tmp_path, monkeypatch, source, "long", table_sizes=SIZES, holdout=0.3)
    assert blocks == lines
    monkeypatch.setattr(pre, "BYTES_PER_CHUNK", 1 << 20)
    monkeypatch.setattr(pre, "LINES_PER_CHUNK", 3)  # a block of 3 lines out of each read
    (_, cut), _ = converted(tmp_path, monkeypatch, source, "cut", table_sizes=SIZES, holdout=0.3)
    assert cut == blocks


BAD_ROWS = {
    "wrong column count": "1" + "\t1" * 12 + "\ta" * 4,
    "bad label": "2" + "\t1" * 13 + "\ta" * 4,
    "non-numeric dense value": "1\tabc" + "\t1" * 12 + "\ta" * 4,
    "non-hex token": "1" + "\t1" * 13 + "\ta\t0x12\ta\ta",
    "not UTF-8 text": "1\t\udcff" + "\t1" * 12 + "\ta" * 4,
}


def write_rows(path, rows):
    path.write_bytes(b"".join(row.encode("utf-8", "surrogateescape") + b"\n" for row in rows))
    return path


@pytest.mark.parametrize("reason", sorted(BAD_ROWS))
def test_a_bad_row_among_blocks_is_named_by_file_and_line_as_before(tmp_path, monkeypatch, small_chunks, reason):
    rows = criteo_rows(np.random.default_rng(4), 400)
    path = write_rows(tmp_path / "train.tsv", rows[:236] + [BAD_ROWS[reason]] + rows[236:])
    errors = []
    for lines_only in (False, True):
        with monkeypatch.context() as patch:
            if lines_only:
                line_parsers_only(patch)
            with pytest.raises(DataError) as err:
                preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
        errors.append(str(err.value))
        assert err.value.path == str(path) and err.value.line == 237 and reason in str(err.value)
    assert errors[0] == errors[1]


def test_skipped_rows_are_counted_as_by_the_line_parsers(tmp_path, monkeypatch, small_chunks):
    rows = criteo_rows(np.random.default_rng(5), 600)
    for at, bad in zip((3, 50, 51, 300, 470, 599), [*BAD_ROWS.values(), BAD_ROWS["bad label"]], strict=True):
        rows.insert(at, bad)
    source = write_rows(tmp_path / "train.tsv", rows)
    (blocks_meta, blocks), (lines_meta, lines) = converted(tmp_path, monkeypatch, source, "skip", table_sizes=SIZES,
                                                           on_bad_row="skip", holdout=0.2)
    assert blocks == lines and blocks_meta["skipped_rows"] == 6
    assert blocks_meta["skipped_by_reason"] == lines_meta["skipped_by_reason"] == {
        "wrong column count": 1, "bad label": 2, "non-numeric dense value": 1, "non-hex token": 1, "not UTF-8 text": 1}


def jsonl_rows(rng, count, *, odd=False):
    rows = []
    for _ in range(count):
        dense = [float(x) for x in rng.normal(0, 1e6, 3)] + [int(rng.integers(-5, 2**62)), -0.0, 2**64]
        record = {"label": int(rng.integers(0, 2)) if rng.random() < 0.5 else float(rng.integers(0, 2)),
                  "dense": dense, "sparse": [int(rng.integers(0, n)) for n in SIZES]}
        if odd and rng.random() < 0.1:
            record["label"] = bool(record["label"])  # the line parser takes it as a number
        if odd and rng.random() < 0.05:
            record["sparse"][1] = True  # but not as an id
        if odd and rng.random() < 0.1:
            record["sparse"][0 if rng.random() < 0.5 else 3] = -1 if rng.random() < 0.5 else SIZES[3]
        rows.append(json.dumps(record))
    return rows


def test_jsonl_blocks_equal_the_line_parser(tmp_path, monkeypatch, small_chunks):
    rng = np.random.default_rng(6)
    data = "".join(row + "\n" for row in jsonl_rows(rng, 500)).encode()
    with monkeypatch.context() as patch:
        patch.setattr(JsonlParser, "parse_lines", lambda *a, **k: pytest.fail("a plain block left to the lines"))
        chunk = JsonlParser(SIZES).parse(TextBlock.of(data), path="f", first_line=1, bad=None)
    assert_same(chunk, reference(JsonlParser(SIZES), data))
    assert_same(chunk, JsonlParser(None).parse(TextBlock.of(data), path="f", first_line=1, bad=None))

    path = write_rows(tmp_path / "train.jsonl", jsonl_rows(rng, 300) + ['{"label": 1, "dense": [1'])
    with pytest.raises(DataError, match="train.jsonl:301: not valid JSON"):
        preprocess(path, tmp_path / "bin", table_sizes=SIZES, show_progress=False)
    (tmp_path / "odd").mkdir()
    write_rows(tmp_path / "odd" / "train.jsonl", jsonl_rows(rng, 300, odd=True) + ['{"label": 1, "dense": [1'])
    (blocks_meta, blocks), (lines_meta, lines) = converted(tmp_path, monkeypatch, tmp_path / "odd", "jsonl",
                                                           table_sizes=SIZES, on_bad_row="skip")
    assert blocks == lines and blocks_meta["skipped_by_reason"]["not valid JSON"] == 1
    assert blocks_meta["skipped_by_reason"]["non-integer id"] and blocks_meta["skipped_by_reason"]["id out of range"]


def test_avazu_blocks_equal_the_line_parser(tmp_path, monkeypatch, small_chunks):
    rng = np.random.default_rng(7)
    features = len(COLUMNS) - 2
    rows = [",".join([str(10**18 + i), str(i % 2), *(f"{v:x}" if v % 3 else "" for v in rng.zipf(1.5, features))])
            for i in range(800)]
    rows[400] += "\u00e9"  # text beyond ASCII: the line parser's
    source = tmp_path / "avazu"
    source.mkdir()
    write_rows(source / "train.csv", [",".join(COLUMNS), *rows])
    for settings in ({"vocab_min_count": 2}, {"table_sizes": [97] * features}):
        (_, blocks), (_, lines) = converted(tmp_path, monkeypatch, source, "avazu", **settings)
        assert blocks == lines


def test_multi_valued_jsonl_after_one_hot_blocks_converts_as_before(tmp_path, monkeypatch, small_chunks):
    rng = np.random.default_rng(9)
    rows = jsonl_rows(rng, 200)  # one-hot blocks, read whole and written, before the first list is met
    rows += [json.dumps({"label": 1, "dense": [1.0] * 6, "sparse": [1, [2, 3], 0, 2]}), *jsonl_rows(rng, 50)]
    source = write_rows(tmp_path / "train.jsonl", rows)
    (blocks_meta, blocks), (_, lines) = converted(tmp_path, monkeypatch, source, "lists", table_sizes=SIZES)
    assert blocks == lines and blocks_meta["rows"]["train"] + blocks_meta["rows"]["test"] == 251


BOM = b"\xef\xbb\xbf"
STRAY_ENDS = {  # what a writer may add around a file's rows: before the first, after the last row's newline
    "bom": (BOM, b""),
    "blank-line": (b"", b"\n"),
    "whitespace-line": (b"", b" \t "),
    "bom-and-blank-crlf-line": (BOM, b" \r\n"),
}


def criteo_source(directory, rng):
    generate(directory, rows=150, test_rows=40, seed=int(rng.integers(100)), table_sizes=[5, 100, 1000],
             show_progress=False)
    return {}


def avazu_source(directory, rng):
    features = len(COLUMNS) - 2
    rows = [",".join([str(i), str(i % 2), *(f"{v:x}" for v in rng.zipf(1.5, features))]) for i in range(150)]
    directory.mkdir()
    write_rows(directory / "train.csv", [",".join(COLUMNS), *rows])
    return {"vocab_min_count": 1}


def jsonl_source(directory, rng):
    directory.mkdir()
    write_rows(directory / "train.jsonl", jsonl_rows(rng, 150))
    return {"table_sizes": SIZES}


def held_out_from(meta):
    return meta["held_out"] and meta["held_out"]["from_line"]


def array_files(files):
    """What a conversion writes from the rows alone: all but meta.json, which records the sources' hashes."""
    return {name: data for name, data in files.items() if name.name != "meta.json"}


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("make_source", [criteo_source, avazu_source, jsonl_source], ids=["criteo", "avazu", "jsonl"])
def test_a_byte_order_mark_and_a_blank_last_line_convert_as_if_absent(tmp_path, monkeypatch, small_chunks,
                                                                      make_source, compressed):
    clean = tmp_path / "clean"
    settings = make_source(clean, np.random.default_rng(10))
    (expected_meta, expected), (_, lines) = converted(tmp_path, monkeypatch, clean, "clean", **settings)
    assert expected == lines
    for stray, (before, after) in STRAY_ENDS.items():
        source = tmp_path / stray
        shutil.copytree(clean, source)
        for path in (p for p in source.iterdir() if p.name.startswith(("train.", "test."))):
            text = before + path.read_bytes() + after
            path.write_bytes(gzip.compress(text) if compressed else text)
        for meta, files in converted(tmp_path, monkeypatch, source, stray, **settings):  # blocks, then lines
            assert array_files(files) == array_files(expected), stray
            assert (meta["rows"], held_out_from(meta)) == (expected_meta["rows"], held_out_from(expected_meta)), stray


@pytest.mark.parametrize("text, line", [
    (b"ROW\n\nROW\n", 2),  # a blank line among rows
    (b"ROW\nROW\n\n\n", 3),  # two blank lines at the end: the first is among rows
    (b"ROW\n \nROW", 2),
    (b"ROW\n" + BOM + b"ROW\n", 2),  # a byte order mark after the start: text of that line
])
def test_blank_lines_but_the_last_and_a_byte_order_mark_but_the_first_are_named(tmp_path, monkeypatch, text, line):
    row = criteo_rows(np.random.default_rng(11), 1)[0].encode()
    path = tmp_path / "train.tsv"
    path.write_bytes(text.replace(b"ROW", row))
    for lines_only in (False, True):
        with monkeypatch.context() as patch:
            if lines_only:
                line_parsers_only(patch)
            with pytest.raises(DataError) as err:
                preprocess(path, tmp_path / "bin", table_sizes=SIZES, holdout=0, show_progress=False)
        assert err.value.path == str(path) and err.value.line == line
