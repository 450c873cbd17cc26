"""PersistentBatch: the running sequences' per-step state in columns that live across steps
(the idea of vLLM V1's InputBatch, in batchgen's shape).

Every sequence holding a block table holds a slot, 0..n-1, dense: a leaving sequence's hole is
filled by the last slot. A slot's columns are written when its sequence enters (admission, a
fork, readmission after preemption), its block-table row when its table changes, and its
counters (computed tokens, tokens, last token, cumulative logprob, penalty counts) by vector
ops once per step. Nothing is rebuilt from Python lists while the set of sequences holds.

Who writes what: the KVManager enters and removes sequences (every sequence holding a block
table holds a slot), writes table rows after each BlockManager change, the `cow_check` and
`fork_pending` flags, and advances `num_computed` after a step (its one home while a sequence
holds a slot); the OutputProcessor calls `append` with the sampler's tokens. The runner reads
table rows (through StepRows); the sampler reads `sampling_columns(slots)`; the stop check
reads `stop_codes`; the scheduler reads the counters to find decodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from batchgen.sampling import cpu_ops
from batchgen.sampling.grammar import GrammarRows
from batchgen.sampling.named_logprobs import NAMED_LOGPROBS, named_matrix
from batchgen.sampling.sampler import (
    FREQUENCY,
    NO_LOGPROBS,
    NUM_PARAMS,
    PRESENCE,
    ControlRow,
    SamplingColumns,
)
from batchgen.sampling.stop import stop_codes
from batchgen.transfer import to_device

if TYPE_CHECKING:
    from batchgen.engine.sequence import Sequence

# Per-slot columns, stored as rows of a few matrices (so a slot enters or moves with one row
# write per matrix) and exposed by name as column views in `PersistentBatch.cols`.
_INTS = ("num_computed",  # tokens whose K/V is cached (advanced per step by the KVManager)
         "num_tokens",  # prompt + generated (advanced per sampled token)
         "last_token",  # the next decode step's input id
         "num_prompt", "max_tokens", "min_tokens",
         "logprobs",  # top logprobs asked per token; NO_LOGPROBS when none
         "num_blocks",
         "seed",  # the sequence's mixed seed (its draws' key), uint64 bits
         "state_slot",  # its state-pool slot (models with state mixers; KVManager), else -1
         "rope_delta",  # M-RoPE: its decode position is the cache position + this
         "lora")  # its LoRA adapter's device slot (batchgen/lora's gate, at admission), 0: none
_FLAGS = ("ignore_eos", "greedy",
          "penalized",  # any penalty: has rows in the PenaltyState
          "controls",  # logit controls (per-row Python in the sampler)
          "stop_strings",  # stops are its StopChecker's (per-row Python)
          "beam",  # a beam: decodes with its group, never sampled
          "fork_pending",  # a leader whose siblings wait for its prompt (KVManager)
          "cow_check",  # forked since its last reservation: its block may be shared
          "constrained",  # structured outputs: its grammar masks its logits
          "traced")  # trace replay: its group's trace gives its tokens
_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int) -> int:
    """sampler.mix_seeds of one seed in Python integers, as int64 bits (no numpy call)."""
    z = seed & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


class PenaltyState:
    """Per-slot penalty tables on the model's device, [slots, vocab] each, for penalised
    sequences: `counts` of generated ids, `seen` (ids of the prompt or generated: the
    repetition penalty's set) and `offsets` = frequency * count + presence * (count > 0), the
    amount presence/frequency subtract (HF's formula, element by element). Written once when
    a sequence enters, then one element per sequence and step: never rebuilt from a history."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.offsets = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=device)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.counts, self.seen, self.offsets

    def resized(self, capacity: int, live: int) -> PenaltyState:
        """The same state for `capacity` slots (the first `live` kept)."""
        vocab = self.counts.shape[1]
        new = PenaltyState(capacity, vocab, self.counts.device)
        for old, fresh in zip(self.tables(), new.tables()):
            fresh[:live] = old[:live]
        return new

    def move(self, dst: int, src: int) -> None:
        for t in self.tables():
            t[dst] = t[src]

    def enter(self, slot: int, token_ids: list[int], num_prompt: int, freq: torch.Tensor,
              pres: torch.Tensor) -> None:
        """A sequence's rows from its tokens so far (prompt, then generated)."""
        vocab = self.counts.shape[1]
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.counts.device)
        ids = ids[ids < vocab]  # never out of range for checked prompts
        out = torch.tensor(token_ids[num_prompt:], dtype=torch.long, device=ids.device)
        out = out[out < vocab]
        self.seen[slot].zero_()
        self.seen[slot, ids] = True
        self.counts[slot].zero_()
        self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        c = self.counts[slot].float()
        self.offsets[slot] = freq * c + pres * (c > 0)

    def add(self, slots: np.ndarray, tokens: np.ndarray, freq: np.ndarray, pres: np.ndarray
            ) -> None:
        """Each slot generated its token (one per slot): count it, mark it seen, and set its
        offset to frequency * count + presence (a C loop on the CPU when it builds)."""
        dev = self.counts.device
        ops = cpu_ops.load() if dev.type == "cpu" else None
        if ops is not None:
            ops.penalty_add(self.counts, self.seen, self.offsets, slots, tokens, freq, pres)
            return
        s, t = to_device(slots, dev), to_device(tokens, dev)
        self.counts.index_put_((s, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)
        self.seen[s, t] = True
        self.offsets[s, t] = (to_device(freq, dev) * self.counts[s, t].float()
                              + to_device(pres, dev))


class PersistentBatch:
    """Slots and their columns. Host columns are numpy; the PenaltyState ([slots, vocab]
    tables) lives on the model's device, made when the first penalised sequence enters."""

    def __init__(self, capacity: int, vocab_size: int, max_blocks: int,
                 eos_ids: list[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.max_blocks = max_blocks
        self.eos_ids = np.array(eos_ids, np.int64)
        self.device = device
        self.seqs: list[Sequence] = []  # slot -> sequence
        self.ints = np.zeros((0, len(_INTS)), np.int64)
        self.flags = np.zeros((0, len(_FLAGS)), np.bool_)
        self.params = np.zeros((0, NUM_PARAMS), np.float32)
        self.cum_logprob = np.zeros(0, np.float64)  # advanced per sampled token
        self.block_table = np.zeros((0, max_blocks), np.int32)
        self.stop_ids = np.zeros((0, 1), np.int64)  # per slot, -1 pads
        self.cols: dict[str, np.ndarray] = {}  # every column by name (views of the above)
        self.penalties: PenaltyState | None = None  # made when a penalised sequence enters
        self.capacity = 0
        self.moves = 0  # removals so far: slot numbers read before a removal may be stale
        self._grow(max(1, capacity), 1)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    # ---- membership -----------------------------------------------------------------------------
    def enter(self, seq: Sequence, table: list[int], num_computed: int) -> None:
        """Give `seq` the next slot and write its columns: its group's row spec, its own seed
        and counters (`num_computed` tokens of K/V cached), its block table and (penalised)
        its penalty state."""
        spec = seq.group.spec
        if len(self.seqs) == self.capacity or len(spec.stop_ids) > self.stop_ids.shape[1]:
            self._grow(self.capacity * (2 if len(self.seqs) == self.capacity else 1),
                       max(self.stop_ids.shape[1], len(spec.stop_ids)))
        slot = len(self.seqs)
        self.seqs.append(seq)
        group = seq.group
        self.ints[slot] = (num_computed, len(seq.token_ids), seq.token_ids[-1],
                           group.num_prompt_tokens, spec.max_tokens, spec.min_tokens,
                           spec.logprobs, 0, _mix_seed(seq.seed), -1,
                           group.mm.rope_delta if group.mm is not None else 0, group.lora)
        self.flags[slot] = (spec.ignore_eos, spec.greedy, spec.penalized, spec.controls,
                            spec.stop_strings, spec.beam, group.fork_pending, False,
                            spec.constrained, spec.trace is not None)
        self.params[slot] = spec.params
        self.cum_logprob[slot] = seq.cumulative_logprob
        self.stop_ids[slot] = -1
        self.stop_ids[slot, :len(spec.stop_ids)] = spec.stop_ids
        seq.slot = slot
        self.write_table(seq, table, 0)
        if spec.penalized:
            self._enter_penalties(slot, seq)
        elif self.penalties is not None:  # a row next to penalised ones must subtract 0
            self.penalties.offsets[slot].zero_()

    def remove(self, seq: Sequence) -> None:
        """`seq` leaves its slot (finished or preempted): its cumulative logprob goes back to
        the sequence (its result) and the last slot moves into the hole."""
        slot, last = seq.slot, len(self.seqs) - 1
        self.moves += 1
        seq.cumulative_logprob = float(self.cols["cum_logprob"][slot])
        seq.slot = -1
        if slot != last:
            for rows in (self.ints, self.flags, self.params, self.cum_logprob,
                         self.block_table, self.stop_ids):
                rows[slot] = rows[last]
            if self.penalties is not None:
                self.penalties.move(slot, last)
            moved = self.seqs[last]
            self.seqs[slot] = moved
            moved.slot = slot
        self.seqs.pop()

    def copy_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Slots `dst` take the columns of slots `src` (beams continuing other beams of their
        group: same spec, counters and table; no penalty state)."""
        for rows in (self.ints, self.flags, self.params, self.cum_logprob, self.block_table,
                     self.stop_ids):
            rows[dst] = rows[src]

    def clear(self) -> None:
        """Every sequence leaves (an aborted call)."""
        for seq in self.seqs:
            seq.slot = -1
        self.seqs.clear()

    def write_table(self, seq: Sequence, table: list[int], first: int) -> None:
        """Copy the sequence's block table into its row from logical block `first` on (what a
        reservation, a copy-on-write or an entry changed)."""
        self.block_table[seq.slot, first:len(table)] = table[first:]
        self.cols["num_blocks"][seq.slot] = len(table)

    def _grow(self, capacity: int, stop_width: int) -> None:
        """(Re)allocate the columns for `capacity` slots and stop lists of `stop_width` ids,
        keeping the live rows."""
        n = len(self.seqs)
        for name in ("ints", "flags", "params", "cum_logprob", "block_table"):
            old = getattr(self, name)
            new = np.zeros((capacity, *old.shape[1:]), old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)
        stops = np.full((capacity, stop_width), -1, np.int64)
        stops[:n, :self.stop_ids.shape[1]] = self.stop_ids[:n]
        self.stop_ids = stops
        self.cols = {name: self.ints[:, i] for i, name in enumerate(_INTS)}
        self.cols["seed"] = self.ints[:, _INTS.index("seed")].view(np.uint64)
        self.cols.update({name: self.flags[:, i] for i, name in enumerate(_FLAGS)})
        self.cols["params"], self.cols["cum_logprob"] = self.params, self.cum_logprob
        if self.penalties is not None and capacity != self.capacity:
            self.penalties = self.penalties.resized(capacity, n)
        self.capacity = capacity

    def _enter_penalties(self, slot: int, seq: Sequence) -> None:
        """The penalty tables' rows of an entering penalised sequence (made at the first)."""
        if self.penalties is None:
            self.penalties = PenaltyState(self.capacity, self.vocab_size, self.device)
        p = self.cols["params"][slot]
        self.penalties.enter(slot, seq.token_ids, seq.group.num_prompt_tokens,
                             torch.tensor(p[FREQUENCY]), torch.tensor(p[PRESENCE]))

    # ---- per step -------------------------------------------------------------------------------
    @staticmethod
    def rows(slots: np.ndarray) -> np.ndarray | slice:
        """An index for these slots' rows: a slice (views, no copies) when they are slots
        0..k-1 in order, as in a step where every sequence decodes."""
        k = len(slots)
        if k and slots[0] == 0 and slots[-1] == k - 1 and (k < 3 or (slots[1:] > slots[:-1]).all()):
            return slice(0, k)
        return slots

    def sampling_columns(self, slots: np.ndarray, rows: np.ndarray | slice | None = None
                         ) -> SamplingColumns:
        """What the sampler reads for rows drawing from these slots (views when the slots are
        0..k-1; `rows`: their `rows(slots)` when known), with the rows whose logit controls
        need per-row Python, and those under a grammar."""
        c = self.cols
        rows = self.rows(slots) if rows is None else rows
        logprobs = c["logprobs"][rows]
        controls = []
        for j in np.flatnonzero(c["controls"][rows]).tolist():
            seq = self.seqs[int(slots[j])]
            controls.append(ControlRow(j, seq.group.params, seq.token_ids,
                                       seq.group.num_prompt_tokens, seq.group.bad_word_ids))
        grammar = None
        constrained = c["constrained"][rows]
        if constrained.any():
            js = np.flatnonzero(constrained)
            grammar = GrammarRows(js, [self.seqs[int(slots[j])].constraint for j in js.tolist()])
        seen = offsets = None
        if self.penalties is not None and c["penalized"][rows].any():
            idx = rows if isinstance(rows, slice) else to_device(rows, self.device)
            seen, offsets = self.penalties.seen[idx], self.penalties.offsets[idx]
        any_logprobs = bool((logprobs != NO_LOGPROBS).any())
        generated = c["num_tokens"][rows] - c["num_prompt"][rows]
        return SamplingColumns(
            params=c["params"][rows], greedy=c["greedy"][rows], seeds=c["seed"][rows],
            num_generated=generated,
            min_tokens=c["min_tokens"][rows], stop_ids=self.stop_ids[rows],
            ignore_eos=c["ignore_eos"][rows], eos_ids=self.eos_ids, logprobs=logprobs,
            seen=seen, offsets=offsets, controls=controls, any_logprobs=any_logprobs,
            grammar=grammar, named=self._named(slots, logprobs) if any_logprobs else None,
            forced=self._forced(slots, c["traced"][rows], generated))

    def _forced(self, slots: np.ndarray, traced: np.ndarray, generated: np.ndarray
                ) -> np.ndarray | None:
        """The token each row must emit (vLLM's trace replay: its trace at the row's count of
        generated tokens), -1 for rows that draw; None when no row of the step replays."""
        if not traced.any():
            return None
        out = np.full(len(traced), -1, np.int64)
        for j in np.flatnonzero(traced).tolist():
            trace = self.seqs[int(slots[j])].group.spec.trace
            out[j] = trace[min(int(generated[j]), len(trace) - 1)]
        return out

    def _named(self, slots: np.ndarray, logprobs: np.ndarray) -> np.ndarray | None:
        """The ids rows naming theirs report logprobs of (vLLM's logprob_token_ids), as a
        -1-padded matrix; None when no row of the step names any."""
        js = np.flatnonzero(logprobs == NAMED_LOGPROBS)
        if not len(js):
            return None
        ids = [self.seqs[int(slots[j])].group.spec.logprob_ids for j in js.tolist()]
        return named_matrix(ids, js, len(logprobs))

    def append(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray | None,
               rows: np.ndarray | slice | None = None) -> None:
        """Each slot's sequence gained `tokens[i]` (raw logprob `logprobs[i]`): advance the
        token columns and the penalty tables by vector ops."""
        c = self.cols
        rows = self.rows(slots) if rows is None else rows
        c["num_tokens"][rows] += 1
        c["last_token"][rows] = tokens
        if logprobs is not None:
            c["cum_logprob"][rows] += logprobs
        if self.penalties is not None:
            pen = c["penalized"][rows]
            if pen.all():
                s, t = np.asarray(slots), tokens
            elif pen.any():
                s, t = np.asarray(slots)[pen], tokens[pen]
            else:
                return
            p = c["params"]
            self.penalties.add(s, t, p[s, FREQUENCY], p[s, PRESENCE])

    def stop_codes(self, slots: np.ndarray, tokens: np.ndarray,
                   rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Why each slot's sequence stops now that it gained `tokens[i]` (stop.py's codes):
        EOS, its stop ids, min_tokens and max_tokens. Stop strings are its checker's."""
        c = self.cols
        rows = self.rows(slots) if rows is None else rows
        generated = c["num_tokens"][rows] - c["num_prompt"][rows]
        return stop_codes(tokens, generated, c["min_tokens"][rows], c["max_tokens"][rows],
                          self.stop_ids[rows], c["ignore_eos"][rows], self.eos_ids)
