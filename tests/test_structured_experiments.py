"""The structured-output chapter's experiment code (``minisrv.experiments.structured``): the
mask trace, the automaton explored through the matcher and its compression, the masked
probabilities, and the JSON runs' validation."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("xgrammar")

from minisrv.experiments import mask_cost  # noqa: E402
from minisrv.experiments import structured as st  # noqa: E402
from minisrv.grammar import citylm_vocabulary, compile_grammar  # noqa: E402
from minisrv.grammar.reference import constrained_generate  # noqa: E402
from minisrv.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def vocab(citylm):
    model, tok = citylm
    return citylm_vocabulary(tok, size=model.config.vocab_size)


def _words(machine: st.Automaton) -> set[str]:
    """Every text from the start to an accepting state (the machine is acyclic)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for a, text, b in machine.edges:
        out.setdefault(a, []).append((text, b))

    def walk(s: int) -> set[str]:
        here = {""} if s in machine.accepting else set()
        return here | {t + rest for t, b in out.get(s, []) for rest in walk(b)}

    return walk(0)


def test_the_automaton_spells_exactly_the_regex_language(vocab) -> None:
    machine = st.automaton(compile_grammar(vocab, regex=st.PICK))
    names = ("Paris", "Lyon", "Lille", "Nice", "Rome", "Riga")
    assert _words(machine) == {f" {n}." for n in names}
    small = machine.compressed()
    assert _words(small) == _words(machine)
    assert small.n_states < machine.n_states and len(small.edges) < len(machine.edges)
    assert "Paris" in {t for _, t, _ in small.edges}  # a chain of forced letters, one arrow


def test_the_automaton_is_minimal_for_shared_suffixes(vocab) -> None:
    """Prefixes with the same completions are one state: after ``a`` and after ``c``."""
    machine = st.automaton(compile_grammar(vocab, regex=r"(ab|cb)"))
    assert machine.n_states == 3 and len(machine.edges) == 3


def test_an_infinite_language_is_refused(vocab) -> None:
    with pytest.raises(ValueError, match="finite"):
        st.automaton(compile_grammar(vocab, regex=r"a+"), max_states=50)


def test_the_mask_trace_allows_every_chosen_token(citylm, vocab) -> None:
    model, tok = citylm
    grammar = compile_grammar(vocab, regex=st.THREE_CITIES)
    tokens = constrained_generate(model, tok.encode("FR:"), grammar,
                                  SamplingParams(max_new_tokens=40)).tokens
    steps = st.mask_trace(grammar, tokens)
    assert [s.token for s in steps] == tokens
    assert all(bool(s.allowed[s.token]) for s in steps)
    assert steps[-1].allowed.sum() == 1 and tokens[-1] == tok.eos_id  # only <eos> at the end
    assert re.fullmatch(st.THREE_CITIES, tok.decode(tokens))


def test_masked_probabilities_are_the_renormalised_model(citylm, vocab) -> None:
    model, tok = citylm
    grammar = compile_grammar(vocab, regex=st.FULL_STOP)
    prompt = tok.encode("FR:")
    tokens = constrained_generate(model, prompt, grammar, SamplingParams(max_new_tokens=30)).tokens
    steps = st.step_probabilities(model, prompt, grammar, tokens)
    for step in steps:
        assert 0 < step.allowed_mass <= 1 + 1e-6
        assert step.masked == pytest.approx(step.free / step.allowed_mass, rel=1e-4, abs=1e-12)
        assert step.masked >= step.free - 1e-7
    # after the third name the comma CityLM wants is what the full stop's grammar forbids
    lyon = min(range(len(steps)), key=lambda i: steps[i].allowed_mass)
    assert steps[lyon].forbidden == "," and steps[lyon - 1].text == "n"


def test_records_ebnf_gives_two_parseable_records(citylm, vocab) -> None:
    model, tok = citylm
    grammar = compile_grammar(vocab, ebnf=st.RECORDS)
    line = r"[A-Z]{2}: ([A-Z][a-z]+(-[A-Za-z][a-z]+)*, ){2}[A-Z][a-z]+(-[A-Za-z][a-z]+)*\n"
    for seed in range(3):
        params = SamplingParams(max_new_tokens=150, temperature=1.0, seed=seed)
        run = constrained_generate(model, tok.encode(""), grammar, params, jump_forward=True)
        assert re.fullmatch(f"({line}){{2}}", tok.decode(run.tokens))
        assert run.jumped == 8  # ": " and the space after each comma, in both records


def test_mask_cost_and_the_step_are_positive_and_the_step_grows(vocab) -> None:
    assert st.mask_cost_us(vocab, 4, repeats=3, regex=st.THREE_CITIES) > 0
    assert st.fill_cost_us(vocab, 4, repeats=3, regex=st.THREE_CITIES) > 0
    assert 0 < st.decode_step_ms(1) < st.decode_step_ms(64)


def test_the_gpu_part_of_the_mask_is_its_bytes_over_the_h100s_links() -> None:
    from minisrv.configs import H100

    # 64 rows of 32,000 tokens: a 256 kB bitmask copied, 8.2 MB of logits read and written
    want = 256_000 / H100.host_bandwidth + (256_000 + 2 * 8_192_000) / H100.bandwidth
    assert st.gpu_mask_ms(64, 32_000) == pytest.approx(want * 1e3)
    assert st.gpu_mask_ms(64, 32_000) < st.decode_step_ms(64) / 100


def test_the_synthetic_vocabulary_has_the_size_asked() -> None:
    vocab = st.synthetic_vocabulary(2_000)
    assert vocab.size == 2_000 and vocab.stop_ids == (0,)
    assert torch.tensor([len(b) for b in vocab.token_bytes[1:]]).min() >= 1


def test_json_runs_validate_against_the_schema(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("jsonschema")
    from minisrv.grammar import hf_vocabulary
    from minisrv.grammar.tiny_json import write_json_llama
    from minisrv.model import load_model

    model, tokenizer = load_model(write_json_llama(tmp_path / "llama"), "cpu")
    vocab = hf_vocabulary(tokenizer.hf, size=model.config.vocab_size, stop_ids=model.eos_ids)
    grammar = compile_grammar(vocab, json_schema=st.CITY_SCHEMA)
    plain = st.json_runs(model, tokenizer, grammar, st.CITY_SCHEMA, range(3), (0.0, 1.5))
    jump = st.json_runs(model, tokenizer, grammar, st.CITY_SCHEMA, range(3), (0.0, 1.5),
                        jump_forward=True)
    assert plain.valid.all() and jump.valid.all() and len(plain) == 6
    assert (plain.forwards == plain.tokens).all() and (jump.forwards < jump.tokens).all()
    other = dict(st.CITY_SCHEMA, required=["city", "rank", "country"])
    assert not st.json_runs(model, tokenizer, grammar, other, range(1), (0.0,)).valid.any()


def test_the_drawings_show_the_mask_and_the_automaton(citylm, vocab) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("graphviz")
    from minisrv.viz import grammar as vg

    model, tok = citylm
    grammar = compile_grammar(vocab, regex=st.PICK)
    tokens = constrained_generate(model, tok.encode("FR:"), grammar,
                                  SamplingParams(max_new_tokens=10)).tokens
    fig = vg.plot_masks(st.mask_trace(grammar, tokens), vg.token_texts(tok), title="t")
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (len(tokens), tok.vocab_size)
    assert (image == 2).sum() == len(tokens)  # one chosen token per step
    # issue 38: the columns' labels were 7 pt and rotated; now at the house size, one
    # character for each token but the letters, whose two runs are labelled as ranges (a
    # label for each of the 61 columns could not be told apart; round 48)
    ax = fig.axes[0]
    ticks = [*ax.get_xticklabels(), *ax.get_xticklabels(minor=True)]
    assert sorted(t.get_text() for t in ticks) == sorted([*"^$↵␣',-.:", "A–Z", "a–z"])
    assert all(t.get_fontsize() >= 10 for t in ticks)
    where = {t.get_text(): t.get_position()[0] for t in ticks}
    first, last = tok.encode("AZ", bos=False)
    assert where[","] == tok.encode(",", bos=False)[0] and where["A–Z"] == (first + last) / 2
    machine = st.automaton(grammar)
    dot = vg.draw_automaton(machine.compressed()).source
    assert dot.count("doublecircle") == len(machine.compressed().accepting)
    assert "Paris" in dot
    # the leading space is drawn ␣, as in the explorer: quoted, ' ' read as an empty string
    assert "␣" in dot and "' '" not in dot


def test_served_masks_checks_each_request_against_it_alone(citylm, vocab) -> None:
    model, tok = citylm
    prompt = tok.encode("FR:")
    runs = st.served_masks(model, vocab, prompt, {"commas": st.THREE_CITIES,
                                                  "stop": st.FULL_STOP}, max_new_tokens=30)
    commas, stop = runs["commas"], runs["stop"]
    assert commas.identical and stop.identical
    alone = constrained_generate(model, prompt, compile_grammar(vocab, regex=st.THREE_CITIES),
                                 SamplingParams(max_new_tokens=30)).tokens
    assert commas.tokens == alone and commas.tokens[-1] == tok.eos_id
    assert len(stop.tokens) == 30  # the full stop is never reached (the chapter's point)
    assert [s.token for s in commas.steps] == commas.tokens
    assert len(commas.probabilities) == len(commas.tokens)
    # the masks agree until the third name may end: then one allows ',' and the other '.'
    split = next(i for i, (a, b) in enumerate(zip(commas.steps, stop.steps, strict=False))
                 if not torch.equal(a.allowed, b.allowed))
    assert tok.decode(commas.tokens[:split]) == " Paris, Marseille, Ly"
    comma, full_stop = tok.encode(",")[-1], tok.encode(".")[-1]
    assert commas.steps[split].allowed[comma] and not commas.steps[split].allowed[full_stop]
    assert stop.steps[split].allowed[full_stop] and not stop.steps[split].allowed[comma]
    with pytest.raises(ValueError, match="regexes is empty"):
        st.served_masks(model, vocab, prompt, {})


def _decoded(img: str):
    import base64
    import io

    import numpy as np
    from PIL import Image

    data = re.search(r'base64,([^"]+)"', img).group(1)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGBA"))


def test_the_mask_explorer_steps_through_the_served_generation(citylm, vocab) -> None:
    pytest.importorskip("matplotlib")
    from minisrv.viz import grammar as vg

    model, tok = citylm
    ex = vg.mask_explorer(model, tok, steps=6)
    assert ex.default == {"grammar": "three cities, commas", "step": 6}
    runs = st.served_masks(model, vocab, tok.encode("FR:"), dict(vg.MASK_GRAMMARS))
    for name, run in runs.items():
        for step in range(1, 7):
            state = ex.metrics(grammar=name, step=step)
            assert state["allowed"] == int(run.steps[step - 1].allowed.sum())
            assert state["allowed_mass"] == run.probabilities[step - 1].allowed_mass
            assert state["text"] == tok.decode(run.tokens[:step])
            assert state["requests_checked"] == 2
    assert ex.metrics(grammar="three cities, commas", step=1)["text"] == " "
    with pytest.raises(ValueError, match="steps must be"):
        vg.mask_explorer(model, tok, steps=0)


def test_a_cut_step_image_is_the_figure_drawn_up_to_that_step(citylm, vocab) -> None:
    pytest.importorskip("matplotlib")
    from minisrv.viz import grammar as vg

    model, tok = citylm
    grammar = compile_grammar(vocab, regex=st.THREE_CITIES)
    tokens = constrained_generate(model, tok.encode("FR:"), grammar,
                                  SamplingParams(max_new_tokens=40)).tokens
    steps, texts = st.mask_trace(grammar, tokens)[:8], vg.token_texts(tok)
    images = vg.step_images(steps, texts, "t")
    assert len(images) == 8
    for s in (1, 5, 8):
        cut = _decoded(images[s - 1])
        drawn = vg._pixels(vg.plot_masks(steps, texts, "t", shown=s))
        assert cut.shape == drawn.shape
        rows = (cut != drawn).any(axis=(1, 2)).sum()
        assert rows <= 1, f"step {s}: {rows} rows of pixels differ"  # at most the cut line
    figure = vg.plot_masks(steps, texts, "t", shown=3)
    grid = figure.axes[0].images[0].get_array()
    assert (grid[3:] == 3).all() and (grid[:3] < 3).all()  # later rows not drawn yet
    labels = figure.axes[0].get_yticklabels()
    assert [label.get_color() for label in labels[3:]] == ["none"] * 5
    with pytest.raises(ValueError, match="shown must be"):
        vg.plot_masks(steps, texts, "t", shown=9)


def test_the_mask_widget_builds(citylm) -> None:
    pytest.importorskip("ipywidgets")
    from minisrv.viz import grammar as vg

    model, tok = citylm
    box = vg.mask_widget(model, tok, max_new_tokens=30)
    menu, step = box.children[0].children
    assert list(menu.options) == list(vg.MASK_GRAMMARS)
    assert (step.value, step.max) == (25, 30)  # the commas grammar ends at step 25


def test_the_batched_fill_timed_beside_ours_fills_the_same_masks(vocab) -> None:
    """XGrammar's batched fill, timed in the chapter beside minisrv's per-row fill, computes
    the same bitmask rows as each request's own state: the two bars time the same work."""
    import torch
    import xgrammar as xgr

    from minisrv.grammar import compile_grammar

    states = mask_cost.states_in_flight(compile_grammar(vocab, regex=st.THREE_CITIES), vocab, 6)
    bitmask = xgr.allocate_token_bitmask(len(states), vocab.size)
    xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask([s.matcher for s in states],
                                                             bitmask)
    for row, state in enumerate(states):
        logits = torch.zeros(1, vocab.size)
        xgr.apply_token_bitmask_inplace(logits, bitmask[row:row + 1])
        assert torch.equal(torch.isfinite(logits[0]), state.allowed_mask().cpu()), row
