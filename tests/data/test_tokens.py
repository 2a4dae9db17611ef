"""Corpora (markup stripping, splits, cache folder) and token sets (calibration, eval windows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optq.data import corpora
from optq.data.corpora import CorpusError, Split, cache_dir, corpus_parts, split_text
from optq.data.tokens import calibration_tokens, eval_windows, load_text, tokenize
from optq.data.wiki import dump_to_text, strip_wiki_markup

WIKI = """{{Infobox country|name=Nowhere|capital=[[Town]]}}
'''Nowhere''' is a [[country|small country]] in [[Europe]].<ref name="a">{{cite web|url=x}}</ref> It has
{{convert|3|km}} of coast.<ref name="b"/>
<!-- hidden comment -->
== History ==
The [[House of Foo]] ruled from 1200.<ref>Smith, p. 3</ref>
[[File:Map.png|thumb|A map of [[Nowhere]]]]
{| class="wikitable"
| cell one || cell two
|}
See <span class="x">the [http://example.org official site]</span> &ndash; and more.
[[Category:Countries]]
"""


def test_strip_wiki_markup_keeps_prose_and_drops_markup():
    text = strip_wiki_markup(WIKI)
    assert text.splitlines()[0] == "Nowhere is a small country in Europe. It has"
    assert "History" in text.splitlines()  # heading became a plain line
    assert "The House of Foo ruled from 1200." in text
    assert "See the official site \u2013 and more." in text
    for junk in (
        "{{",
        "}}",
        "[[",
        "]]",
        "<ref",
        "Smith",
        "Infobox",
        "cite web",
        "hidden",
        "cell one",
        "Map.png",
        "A map of",
        "Countries",
        "'''",
        "==",
        "<span",
        "&ndash;",
        "http",
    ):
        assert junk not in text, junk


def test_dump_to_text_skips_redirects_and_other_namespaces():
    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
    <page><title>Real</title><ns>0</ns><revision><text>Body with [[a link]].</text></revision></page>
    <page><title>Moved</title><ns>0</ns><redirect title="Real"/>
      <revision><text>#REDIRECT [[Real]]</text></revision></page>
    <page><title>Talk:Real</title><ns>1</ns><revision><text>chatter</text></revision></page>
    <page><title>Second</title><ns>0</ns><revision><text>Text &lt;ref&gt;x&lt;/ref&gt;two.</text></revision></page>
    </mediawiki>"""
    assert dump_to_text(xml) == "Real\n\nBody with a link.\n\nSecond\n\nText two.\n"


@pytest.mark.parametrize("length", [50, 120, 1000])
@pytest.mark.parametrize("split", [Split(calib_chars=40), Split(calib_chars=40, eval_chars=30)])
def test_split_never_overlaps(length, split):
    text = "".join(chr(0x4E00 + i) for i in range(length))  # all characters distinct
    calib, evaluation = split_text(text, split)
    assert calib == text[: len(calib)] and evaluation == text[len(text) - len(evaluation) :]
    assert len(calib) + len(evaluation) <= length and not set(calib) & set(evaluation)
    assert len(calib) == min(40, length) and evaluation
    if split.eval_chars and length >= 70:
        assert len(evaluation) == 30


def test_split_without_eval_text_is_an_error():
    with pytest.raises(CorpusError, match="nothing is left to evaluate"):
        split_text("x" * 40, Split(calib_chars=40))


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("OPTQ_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "optq"
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("OPTQ_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "optq"


def test_named_corpus_read_from_cache_and_split(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    # Any download attempt would fail the test: the cached text must be used as is.
    monkeypatch.setattr(corpora, "_run", lambda *a, **k: pytest.fail("tried to download"))
    (tmp_path / "corpora").mkdir()
    text = "".join(f"line {i}\n" for i in range(30_000))
    (tmp_path / "corpora" / "debref-xx.txt").write_text(text, encoding="utf-8")
    calib, evaluation = corpus_parts("debref-xx")
    assert calib == text[:100_000] and evaluation == text[100_000:]
    assert load_text("debref-xx", "eval") == evaluation


def test_unknown_corpus_lists_known_names(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    with pytest.raises(CorpusError, match="known corpora: enwiki, news"):
        load_text("no-such-corpus")
    with pytest.raises(CorpusError, match="known: enwiki, news, pydoc, code, debref-en"):
        corpora.fetch_corpus("wikitext")


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("abcdefghi", encoding="utf-8")
    assert load_text(txt, "calib") == "abcdef" and load_text(txt, "eval") == "ghi"
    assert load_text(txt, "all") == "abcdefghi"
    jl = tmp_path / "b.jsonl"
    jl.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    assert load_text(jl, "all", field="body") == "one\n\ntwo"
    with pytest.raises(CorpusError, match="no string field 'text'"):
        load_text(jl, "all")
    with pytest.raises(ValueError, match="part must be one of"):
        load_text(txt, "test")


def test_hf_dataset_without_library_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    with pytest.raises(CorpusError, match="needs the Hugging Face `datasets` library"):
        load_text("hf:wikitext:wikitext-2-raw-v1", "eval")


def test_tokenize_adds_no_special_tokens():
    class Tok:
        def __call__(self, text, add_special_tokens=True, verbose=True):
            ids = [ord(c) for c in text]
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    ids = tokenize("hi!", Tok())
    assert ids.dtype == torch.long and ids.tolist() == [104, 105, 33]


def test_calibration_windows_are_seeded_and_from_the_text():
    tokens = torch.arange(10_000) * 3  # strictly increasing: a window's origin is unambiguous
    a = calibration_tokens(tokens, 16, 64, seed=0)
    assert a.shape == (16, 64) and a.dtype == torch.long
    assert torch.equal(a, calibration_tokens(tokens, 16, 64, seed=0))
    assert not torch.equal(a, calibration_tokens(tokens, 16, 64, seed=1))
    starts = a[:, 0] // 3
    assert torch.equal(a, tokens[starts[:, None] + torch.arange(64)])
    assert int(starts.max()) <= 10_000 - 64 - 1 and len(set(starts.tolist())) > 1


def test_calibration_uses_every_start_position():
    tokens = torch.arange(21)  # seqlen 20 needs 21 tokens: starts 0 only
    assert calibration_tokens(tokens, 5, 20, seed=3).tolist() == [list(range(20))] * 5
    seen = set(calibration_tokens(torch.arange(24), 400, 20, seed=0)[:, 0].tolist())
    assert seen == {0, 1, 2, 3}


def test_calibration_too_short_says_how_many_tokens():
    with pytest.raises(ValueError, match="has 100 tokens; windows of 100 need at least 101"):
        calibration_tokens(torch.arange(100), 4, 100, seed=0)


def test_eval_windows_without_and_with_bos():
    tokens = torch.arange(100, 140)
    plain = eval_windows(tokens, 8)
    assert plain.shape == (5, 8) and torch.equal(plain.flatten(), tokens)
    with_bos = eval_windows(tokens, 8, windows=3, bos_id=1)
    assert with_bos.shape == (3, 8) and with_bos[:, 0].tolist() == [1, 1, 1]
    assert torch.equal(with_bos[:, 1:].flatten(), tokens[:21])
    assert eval_windows(tokens.unsqueeze(0), 8, windows=2).tolist() == plain[:2].tolist()


def test_eval_windows_too_many_is_an_error():
    with pytest.raises(ValueError, match="has 40 tokens, enough for 5 windows of 8 text tokens; 6 windows need 48"):
        eval_windows(torch.arange(40), 8, windows=6)
    with pytest.raises(ValueError, match="enough for 0 windows"):
        eval_windows(torch.arange(5), 8)


def test_real_corpus_paths_are_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTQ_CACHE", str(tmp_path))
    assert corpora._cache_file("enwiki") == tmp_path / "corpora" / "enwiki.txt"
    assert Path(corpora._cache_file("code")).parent == tmp_path / "corpora"


def test_mixed_calibration_shares_windows_equally():
    from optq.data.tokens import mixed_calibration

    streams = [torch.arange(0, 1000), torch.arange(10_000, 10_500), torch.arange(20_000, 20_300)]
    mix = mixed_calibration(streams, nsamples=8, seqlen=16, seed=5)
    assert mix.shape == (8, 16)
    # 8 = 3 + 3 + 2 windows, stream by stream, each contiguous and inside its stream
    owners = [int(row[0]) // 10_000 for row in mix]
    assert owners == [0, 0, 0, 1, 1, 1, 2, 2]
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 16)) for row in mix)
    # each share is that stream's own seeded draw (seed + its index)
    assert torch.equal(mix[3:6], calibration_tokens(streams[1], 3, 16, seed=6))
    # one stream is calibration_tokens itself
    assert torch.equal(mixed_calibration(streams[:1], 8, 16, seed=5), calibration_tokens(streams[0], 8, 16, seed=5))
    with pytest.raises(ValueError, match="cannot be shared by 3"):
        mixed_calibration(streams, nsamples=2, seqlen=16)


def test_split_sources_keeps_a_file_with_a_comma(tmp_path):
    from optq.data.tokens import split_sources

    assert split_sources("enwiki, debref-de ,code") == ["enwiki", "debref-de", "code"]
    odd = tmp_path / "a,b.txt"
    odd.write_text("text")
    assert split_sources(str(odd)) == [str(odd)]
    with pytest.raises(ValueError, match="names no calibration source"):
        split_sources(" , ")
