"""The architecture a fork's checks compare with its checkpoint's (``train CONFIG checkpoint.resume_from=DIR``):
the one the config gives the model at the checkpoint's step; the growth points it shares with the checkpoint's run.
The tokenizer a run resumed by its id trains with (the run directory's). The checks themselves, through the CLI:
``tests/integration/checkpoint/test_resume_guard.py``."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError
from pretrain.driver.resume import _as_built, _resolved_points
from tests.harness import tiny_config


def test_the_architecture_compared_is_the_configs_at_the_checkpoints_step():
    cfg = tiny_config("model.num_layers=2", "growth.schedule=[{at_step: 3, depth: 2x}, {at_step: 6, depth: 2x}]")
    saved = tiny_config("model.num_layers=4")
    assert _as_built(cfg, saved, step=3).model.num_layers == 2  # grows after step 3: its checkpoint is the model before
    assert _as_built(cfg, saved, step=4).model.num_layers == 4  # grown once
    assert _as_built(cfg, saved, step=6).model.num_layers == 4
    assert _as_built(cfg, saved, step=9).model.num_layers == 8
    assert _as_built(cfg, saved, step=4).train == cfg.train
    plain = tiny_config()
    assert _as_built(plain, saved, step=3) is plain
    with pytest.raises(ConfigError, match=r"^model\.init_from_hf \(/models/a\) with checkpoint\.resume_from: "):
        _as_built(tiny_config("model.init_from_hf=/models/a"), saved, step=1)


def test_a_fork_takes_the_steps_its_checkpoints_run_resolved_its_growth_points_to():
    given = (
        "growth.schedule=[{at_fraction: 0.1, depth: 2x}, {at_tokens: 640, depth: 2x}, {at_fraction: 0.5, depth: 2x}]"
    )
    cfg = tiny_config("model.num_layers=1", "train.max_flops=1e12", given)
    saved = tiny_config("model.num_layers=1", "train.max_flops=1e12", given)
    for entry, step in zip(saved.growth.schedule, (4, 9, 20)):
        entry.at_step = step  # as the run resolved them (its checkpoint's config.yaml)
    saved.growth.schedule[2].depth = "4x"  # not the same growth: no step taken from it
    _resolved_points(cfg, saved)
    assert [e.at_step for e in cfg.growth.schedule] == [4, 9, 0]
    assert _as_built(cfg, saved, step=10).model.num_layers == 4
    fixed = tiny_config("model.num_layers=1", "growth.schedule=[{at_step: 3, depth: 2x}]")
    _resolved_points(fixed, saved)
    assert fixed.growth.schedule[0].at_step == 3, "a step given stays"


def _contents(cfg, step: int):
    from pretrain.checkpoint.writer import Contents, FullWeights

    return Contents(cfg=cfg, trainer_state={"step": step}, data_state={}, model=FullWeights({"a": torch.zeros(2)}))


def _resumable_run(tmp_path, monkeypatch, keep_last=1):
    """A run directory as a run creates it (its own ``tokenizer/``), one checkpoint committed, found by its id."""
    from pretrain.checkpoint.writer import CheckpointWriter, LocalWorld
    from pretrain.driver import resume
    from pretrain.train import tracking

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    root = tmp_path / "ckpts" / "run-1"
    (root / "tokenizer").mkdir(parents=True)
    (root / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    cfg = tiny_config(f"data.sources=[{{path: {corpus}}}]", f"data.tokenizer={root / 'tokenizer'}", "train.max_steps=9")
    writer = CheckpointWriter(root, LocalWorld(), "run-1", keep_last=keep_last)
    writer.save(_contents(cfg, 1))
    monkeypatch.setattr(tracking, "tracking_uri", lambda: "")
    monkeypatch.setattr(tracking, "run_checkpoint_root", lambda uri, run_id: root)
    monkeypatch.setattr(resume, "preflight", lambda cfg, **_: [])  # Ray, the corpus: not what is tested here
    return root, writer


def test_a_run_resumed_by_its_id_saves_its_own_tokenizer_after_retention_pruned_its_checkpoint(tmp_path, monkeypatch):
    """``resume RUN_ID`` trains with the run directory's tokenizer, not its checkpoint's copy: saves go on copying
    it after ``checkpoint.keep_last`` deleted the checkpoint resumed from."""
    from pretrain.checkpoint import layout, list_committed
    from pretrain.config import from_dict
    from pretrain.driver.resume import prepare_resume

    root, writer = _resumable_run(tmp_path, monkeypatch)
    job = prepare_resume("run-1", ["tracking.enabled=false"])
    cfg = from_dict(job.config)
    assert cfg.data.tokenizer == str(root / layout.RUN_TOKENIZER)
    for step in (2, 3):  # step 2's save prunes step 1, the checkpoint resumed from
        writer.save(_contents(cfg, step))
        writer.settle()
    assert [c.step for c in list_committed(root)] == [3]


def test_a_run_resumed_by_its_id_restores_a_missing_tokenizer_and_refuses_another(tmp_path, monkeypatch):
    """A run directory whose tokenizer differs from its checkpoint's is refused in one line; one without a tokenizer
    gets the checkpoint's copy back."""
    from pretrain.driver.resume import prepare_resume

    root, _ = _resumable_run(tmp_path, monkeypatch)
    (root / "tokenizer" / "tokenizer.json").write_text('{"model": {"other": 1}}')
    with pytest.raises(ConfigError, match=r"tokenizer: not the tokenizer of checkpoint .*step_00000001, which the run"):
        prepare_resume("run-1", ["tracking.enabled=false"])
    (root / "tokenizer" / "tokenizer.json").unlink()
    (root / "tokenizer").rmdir()
    prepare_resume("run-1", ["tracking.enabled=false"])
    assert (root / "tokenizer" / "tokenizer.json").read_text() == '{"model": {}}'


def test_resume_by_id_puts_back_a_checkpoint_an_interrupted_recommit_set_aside(tmp_path, monkeypatch):
    """Killed between a re-commit's two renames, a run's only checkpoint sits under its set-aside name: ``resume
    RUN_ID``, holding the run's lock, puts it back before it looks for the latest checkpoint."""
    from contextlib import ExitStack

    from pretrain.checkpoint import layout
    from pretrain.driver.resume import prepare_resume

    root, _ = _resumable_run(tmp_path, monkeypatch)
    (root / layout.step_dir_name(1)).rename(layout.superseded_dir(root, 1, "abc"))
    with ExitStack() as hold:
        job = prepare_resume("run-1", ["tracking.enabled=false"], hold)
    assert job.run_dir == str(root) and (root / layout.step_dir_name(1) / layout.MANIFEST).is_file()


def test_a_tokenizer_given_at_resume_is_refused_not_dropped():
    """A resume trains on with its checkpoint's tokenizer: ``data.tokenizer=`` would be replaced unseen, so it is
    refused in one line, before anything is read."""
    from pretrain.driver.resume import prepare_resume

    for given in ("data.tokenizer=/tmp/other_tok", "data={tokenizer: /tmp/other_tok}"):  # in either form
        with pytest.raises(ConfigError, match=r"^data\.tokenizer cannot be given at resume: /no/such trains on with"):
            prepare_resume("/no/such", [given])


def test_a_run_resumed_by_its_id_records_where_it_is_and_refuses_another_checkpoint_dir(tmp_path, monkeypatch):
    """A run trains on in its own directory: its resumed config records that directory's parent as
    ``checkpoint.dir`` (a relative dir read from another working directory would point elsewhere), and a
    ``checkpoint.dir=`` given, which would be recorded but not used, is refused in one line."""
    from pretrain.config import from_dict
    from pretrain.driver.resume import prepare_resume

    root, _ = _resumable_run(tmp_path, monkeypatch)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where a relative checkpoint.dir of the saved config resolves elsewhere
    assert from_dict(prepare_resume("run-1", ["tracking.enabled=false"]).config).checkpoint.dir == str(root.parent)
    for given in (f"checkpoint.dir={tmp_path / 'elsewhere'}", f"checkpoint={{dir: {tmp_path / 'elsewhere'}}}"):
        with pytest.raises(ConfigError, match=rf"^checkpoint\.dir cannot change at resume of run run-1: .* {root};"):
            prepare_resume("run-1", ["tracking.enabled=false", given])
    assert not (tmp_path / "elsewhere").exists()
    prepare_resume("run-1", ["tracking.enabled=false", f"checkpoint.dir={root.parent}"])  # where it is: no change
