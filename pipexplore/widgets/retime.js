// Re-timing a plan in the page after a drag (see pipexplore/predict/retime.py): the layers of the new
// split summed per stage, the step's graph timed by the processor-sharing loop of _sharing.c
// (the same steps: each action starts when its worker is free and its inputs are there; actions
// on one device that ask for more than all of it slow down in proportion), and the result laid out
// as the predicted panel's blocks. FSDP's gathers and reduce-scatters are placed from torch's
// lowering the model carries (fsdpCosts, as pipexplore/predict/fsdp_actions.py places them), and a
// mesh rank's collectives drawn in each stage's collectives lane (collectiveRows, as
// pipexplore/predict/mesh_costs.py's collective_rows). The kernel predicts the same plan meanwhile
// and its scene then replaces this one; tests compare the two.

// A typed array over a binary buffer of the scene (a DataView from the widget's message).
function typed(view, Type) {
  if (!view) return new Type(0);
  if (ArrayBuffer.isView(view) || view instanceof ArrayBuffer) {
    const buffer = view.buffer || view, offset = view.byteOffset || 0, length = view.byteLength;
    if (offset % Type.BYTES_PER_ELEMENT === 0) return new Type(buffer, offset, length / Type.BYTES_PER_ELEMENT);
    return new Type(buffer.slice(offset, offset + length));
  }
  return Type.from(view);  // a plain list (a scene written as JSON)
}

// The model's buffers as typed arrays, once per model.
function decodeRetime(raw) {
  const f64 = (k) => typed(raw[k], Float64Array), i32 = (k) => typed(raw[k], Int32Array);
  return {
    ...raw, seconds: f64("seconds"), raw: f64("raw"), weighted: f64("weighted"), share_cap: f64("share_cap"),
    copy_rates: f64("copy_rates"), out_bytes: f64("out_bytes"), fractions: f64("fractions"), fresh: f64("fresh"),
    size_of_micro: i32("size_of_micro"), resource: i32("resource"), first: i32("first"), second: i32("second"),
    stage: i32("stage"), kind: typed(raw.kind, Uint8Array), micro: i32("micro"), queue_len: i32("queue_len"),
    lanes_at: i32("lanes_at"), lanes: i32("lanes"), fsdp: decodeFsdp(raw.fsdp),
    collectives: raw.collectives ? { ...raw.collectives, seconds: typed(raw.collectives.seconds, Float64Array),
      rows: typed(raw.collectives.rows, Float64Array) } : null,
  };
}

// FSDP's part of the model (retime.py's _fsdp_model): its per-layer seconds, the lowered workers'
// steps and the actions they change, as typed arrays; null without FSDP.
function decodeFsdp(f) {
  if (!f) return null;
  return {
    unshard: typed(f.unshard, Float64Array), reduce_grad: typed(f.reduce_grad, Float64Array),
    regather: typed(f.regather, Float64Array), ops: typed(f.ops, Int32Array), ops_at: typed(f.ops_at, Int32Array),
    updates: typed(f.updates, Int32Array), again: typed(f.again, Int32Array),
  };
}

// Per stage, the sum of a layer array (from `offset`) over the stage's layers, `points` its
// boundaries: differences of running totals, as numpy's cumsum has them (costs.stage_sums).
function stageSums(values, offset, points, S, L) {
  const total = new Float64Array(L + 1);
  for (let l = 0; l < L; l++) total[l + 1] = total[l] + values[offset + l];
  const out = new Float64Array(S);
  for (let s = 0; s < S; s++) out[s] = total[points[s + 1]] - total[points[s]];
  return out;
}

// A binary heap of (key, tie, queue) entries, least key (then tie) first, in typed arrays (the
// loop pushes and pops one per action: no object per entry).
class Heap {
  constructor(capacity = 64) {
    this.key = new Float64Array(capacity);
    this.tie = new Float64Array(capacity);
    this.q = new Int32Array(capacity);
    this.size = 0;
  }
  less(i, key, tie) { return this.key[i] < key || (this.key[i] === key && this.tie[i] < tie); }
  push(key, tie, q) {
    if (this.size === this.key.length) {
      for (const name of ["key", "tie", "q"]) {
        const grown = new this[name].constructor(2 * this.size);
        grown.set(this[name]);
        this[name] = grown;
      }
    }
    let i = this.size++;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      const above = this.key[parent];
      if (!(key < above || (key === above && tie < this.tie[parent]))) break;
      this.key[i] = this.key[parent]; this.tie[i] = this.tie[parent]; this.q[i] = this.q[parent];
      i = parent;
    }
    this.key[i] = key; this.tie[i] = tie; this.q[i] = q;
  }
  // Removes the least entry and returns its queue (its key and tie are read before, at 0).
  pop() {
    const top = this.q[0], n = --this.size;
    if (!n) return top;
    const key = this.key[n], tie = this.tie[n], q = this.q[n];
    let i = 0;
    for (;;) {
      let child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && (this.key[child + 1] < this.key[child] ||
          (this.key[child + 1] === this.key[child] && this.tie[child + 1] < this.tie[child]))) child++;
      if (!this.less(child, key, tie)) break;
      this.key[i] = this.key[child]; this.tie[i] = this.tie[child]; this.q[i] = this.q[child];
      i = child;
    }
    this.key[i] = key; this.tie[i] = tie; this.q[i] = q;
    return top;
  }
}

// Per action: seconds, share of its device, copy of its input, and the waits after its first and
// second input, for the stage boundaries `points` ([0, ...splits, layers]), as simulate() has them.
function actionCosts(m, points) {
  // The graph's kinds (F B R I W O), then C (a checkpointed F): as many as the model has extras.
  const S = m.stages, L = m.layers, Z = m.sizes, n = m.actions, K = m.extra.length, C = K - 1;
  const sums = (values, offset) => stageSums(values, offset, points, S, L);
  const took = [], asked = [];  // [kind * Z + size] -> per stage
  for (let k = 0; k < K; k++) {
    for (let z = 0; z < Z; z++) {
      const at = (k * Z + z) * L;
      const seconds = sums(m.seconds, at).map((v) => v + m.extra[k]);
      if (m.zero_bubble && (k === 3 || k === 4)) {  // the first stage's I is its whole backward, its W nothing
        const whole = sums(m.seconds, (1 * Z + z) * L)[0];
        seconds[0] = k === 3 ? whole + m.extra[k] : 0.0;
      }
      let share;
      if (m.has_share[k]) {
        const raw = sums(m.raw, at), weighted = sums(m.weighted, at);
        share = raw.map((t, s) => (t > 0 ? weighted[s] / t : 0.0));
      } else {
        share = new Float64Array(S).fill(1.0);
      }
      took.push(seconds);
      asked.push(share.map((v, s) => Math.min(Math.min(Math.max(v, 0.0), 1.0), m.share_cap[s])));
    }
  }
  const copy = new Float64Array(n), firstWait = new Float64Array(n), secondWait = new Float64Array(n);
  const seconds = new Float64Array(n), share = new Float64Array(n);
  // A step's first backward of each stage allocates its gradients (its W where the backward is
  // split; the first stage's I, which does its weights too), as simulate() charges it.
  const fresh = sums(m.fresh, 0), weights = m.zero_bubble ? m.weight_grad : m.backward;
  const edge = (b, i) => m.copy_rates[b] * m.out_bytes[points[b + 1] - 1] * m.fractions[i];
  for (let a = 0; a < n; a++) {
    // (an optimizer step's micro-batch is -1: its cost has no rows)
    const s = m.stage[a], i = m.micro[a], z = i < 0 ? 0 : m.size_of_micro[i];
    const k = m.kind[a] === m.forward && i < m.stop ? C : m.kind[a];
    seconds[a] = took[k * Z + z][s];
    if (i === 0 && ((m.kind[a] === weights && (s > 0 || !m.zero_bubble)) || (m.kind[a] === m.input_grad && s === 0))) {
      seconds[a] += fresh[s];
    }
    share[a] = asked[k * Z + z][s];
    if (m.kind[a] === m.forward && s > 0) {
      copy[a] = edge(s - 1, i);
      firstWait[a] = copy[a] + m.handoff;
    }
    if (m.second[a] < n) secondWait[a] = edge(s, i) + m.handoff;
  }
  const placed = m.fsdp ? fsdpCosts(m, points, seconds, secondWait) : null;
  return { seconds, share, copy, firstWait, secondWait, placed };
}

// FSDP's UNSHARDs and REDUCE_GRADs placed where torch's lowering puts them, and what they add to
// the actions (pipexplore/predict/fsdp_actions.py: fsdp_placement, then placed_fsdp; the same
// arithmetic in the same order). Per lowered worker: its computes' clock (their seconds summed);
// a gather issued before its first compute runs on one stream from the step's start and its use
// may not start before it is done (a release: the wait after an action's second input, or seconds
// where it has one); one issued later adds what the compute between its issue and its use does not
// hide; a reduce-scatter runs after its stage's last backward behind the compute left, and what that
// hides comes off its stage's update. Backwards that gather their stage again add its gather.
// Returns the placements (placement_record's): per gather [use, seconds, at the start, release,
// exposed], per reduce-scatter [the action it follows, seconds, hidden], and the backwards that
// gather again.
function fsdpCosts(m, points, seconds, secondWait) {
  const f = m.fsdp, S = m.stages, L = m.layers, n = m.actions, stage = m.stage, second = m.second;
  const unshard = stageSums(f.unshard, 0, points, S, L), reduceGrad = stageSums(f.reduce_grad, 0, points, S, L);
  const regather = stageSums(f.regather, 0, points, S, L);
  const release = new Float64Array(n), extra = new Float64Array(n), less = new Float64Array(S);
  const issuedAt = new Int32Array(S), done = new Float64Array(S);  // a stage's pending gather
  const ops = f.ops, at = f.ops_at, unshards = [], reduces = [];
  for (let w = 0; w + 1 < at.length; w++) {
    const lo = at[w], hi = at[w + 1];
    let count = 0;
    for (let j = lo; j < hi; j++) if (ops[2 * j] === 0) count++;
    const clock = new Float64Array(count + 1);  // compute done before each of the worker's computes
    count = 0;
    for (let j = lo; j < hi; j++) {
      if (ops[2 * j] === 0) { clock[count + 1] = clock[count] + seconds[ops[2 * j + 1]]; count++; }
    }
    const total = clock[count];
    let stream = 0.0, scatter = 0.0, seen = 0, last = -1;
    issuedAt.fill(-1);
    for (let j = lo; j < hi; j++) {
      const code = ops[2 * j], value = ops[2 * j + 1];
      if (code === 1) {  // UNSHARD of stage `value`
        const atStart = seen === 0;
        if (atStart) stream += unshard[value];
        issuedAt[value] = seen;
        done[value] = atStart ? stream : unshard[value];
      } else if (code === 2) {  // REDUCE_GRAD of stage `value`
        const before = Math.max(0.0, scatter - total);
        scatter = Math.max(scatter, clock[seen]) + reduceGrad[value];
        const hidden = reduceGrad[value] - (Math.max(0.0, scatter - total) - before);
        less[value] += hidden;
        reduces.push([last, reduceGrad[value], hidden]);
      } else {  // compute action `value`
        const s = stage[value], issued = issuedAt[s];
        if (issued >= 0) {
          issuedAt[s] = -1;
          if (issued === 0) {
            release[value] = Math.max(release[value], done[s]);
            unshards.push([value, unshard[s], true, done[s], 0.0]);
          } else {
            const exposed = Math.max(0.0, done[s] - (clock[seen] - clock[issued]));
            extra[value] += exposed;
            unshards.push([value, done[s], false, 0.0, exposed]);
          }
        }
        seen++;
        last = value;
      }
    }
  }
  for (let a = 0; a < n; a++) {
    if (second[a] === n) {
      secondWait[a] = Math.max(secondWait[a], release[a]);
      seconds[a] += extra[a] + 0.0;
    } else {
      seconds[a] += extra[a] + release[a];
    }
  }
  for (const a of f.updates) seconds[a] -= less[stage[a]];
  const again = regather.some((v) => v !== 0) ? f.again : new Int32Array(0);  // (fsdp_actions: regather.any())
  for (const a of again) seconds[a] += regather[stage[a]];
  return { unshards, reduces, again };
}

// The processor-sharing loop (pipexplore/predict/_sharing.c's run): rows in the order it emits them.
function shareLoop(m, c) {
  const n = m.actions, Q = m.queue_len.length, S = m.stages, free = m.free, gap = m.gap;
  const { first, second, stage, kind, lanes_at: lanesAt, lanes } = m;
  const end = new Float64Array(n + 1).fill(-1.0);
  end[n] = 0.0;
  const base = new Int32Array(Q), heads = new Int32Array(Q), freeAt = new Float64Array(Q);
  for (let q = 1; q < Q; q++) base[q] = base[q - 1] + m.queue_len[q - 1];
  const timed = new Float64Array(Q), hasTimed = new Uint8Array(Q), dirty = new Uint8Array(Q).fill(1);
  const running = new Uint8Array(Q), runR = new Int32Array(Q), runN = new Int32Array(Q);
  const runShare = new Float64Array(Q), runStart = new Float64Array(Q);
  const dirtyList = new Int32Array(Q);
  for (let q = 0; q < Q; q++) dirtyList[q] = q;
  let ndirty = Q;
  const clock = new Float64Array(free + 1), demand = new Float64Array(free + 1);
  const finishing = Array.from({ length: free + 1 }, () => new Heap());
  const seen = new Uint8Array(free + 1), seenOrder = new Int32Array(free + 1);
  let seenCount = 0;
  const advancing = new Int32Array(free + 1), advancingRate = new Float64Array(free + 1);
  const wakes = new Heap();
  const outAction = new Int32Array(2 * n), outStart = new Float64Array(2 * n), outEnd = new Float64Array(2 * n);
  const outCopy = new Uint8Array(2 * n);
  let count = 0;
  const { seconds: took, share: asked, copy: copyOf, firstWait, secondWait } = c;
  const queueLen = m.queue_len, resource = m.resource, forward = m.forward, backward = m.backward;
  const inputGrad = m.input_grad;
  const mark = (q) => { if (!dirty[q]) { dirty[q] = 1; dirtyList[ndirty++] = q; } };
  const eps = 1e-12;
  let remaining = n, order = 0, now = 0.0;
  while (remaining) {
    while (wakes.size && wakes.key[0] <= now + eps) {
      const key = wakes.key[0], q = wakes.pop();
      if (hasTimed[q] && timed[q] === key) { hasTimed[q] = 0; mark(q); }
    }
    // The queues to look at, ascending (a handful per event: an insertion sort).
    for (let i = 1; i < ndirty; i++) {
      const q = dirtyList[i];
      let j = i;
      for (; j > 0 && dirtyList[j - 1] > q; j--) dirtyList[j] = dirtyList[j - 1];
      dirtyList[j] = q;
    }
    const looked = ndirty;
    ndirty = 0;
    for (let i = 0; i < looked; i++) {
      const q = dirtyList[i];
      dirty[q] = 0;
      if (running[q] || heads[q] >= queueLen[q]) continue;
      const a = base[q] + heads[q];
      let t = end[first[a]];
      if (t < 0) continue;
      t += firstWait[a];
      let later = end[second[a]];
      if (later < 0) continue;
      later += secondWait[a];
      if (later > t) t = later;
      const start = freeAt[q] > t ? freeAt[q] : t;
      if (start > now + eps) {
        if (!hasTimed[q] || timed[q] !== start) {
          hasTimed[q] = 1;
          timed[q] = start;
          wakes.push(start, q, q);
        }
        continue;
      }
      const share = asked[a], r = share > 0 ? resource[stage[a]] : free;
      if (!seen[r]) { seen[r] = 1; seenOrder[seenCount++] = r; }
      if (!finishing[r].size) { clock[r] = 0.0; demand[r] = 0.0; }
      finishing[r].push(clock[r] + took[a], order++, q);
      demand[r] += share;
      running[q] = 1; runR[q] = r; runShare[q] = share; runStart[q] = now; runN[q] = a;
      if (copyOf[a] > 0) {
        const done = end[first[a]];
        outAction[count] = a; outStart[count] = done; outEnd[count] = done + copyOf[a]; outCopy[count++] = 1;
      }
    }
    while (wakes.size && !(hasTimed[wakes.q[0]] && timed[wakes.q[0]] === wakes.key[0])) wakes.pop();  // stale
    const wake = wakes.size ? wakes.key[0] : Infinity;
    let step = wake - now, moving = 0;
    for (let i = 0; i < seenCount; i++) {
      const r = seenOrder[i], heap = finishing[r];
      if (!heap.size) continue;
      const d = demand[r], rate = r !== free && d > 1.0 ? 1.0 / d : 1.0;
      const left = (heap.key[0] - clock[r]) / rate;
      if (left < step) step = left;
      advancing[moving] = r;
      advancingRate[moving++] = rate;
    }
    if (!moving) {
      if (wake === Infinity) throw new Error("the schedule deadlocked: no stage can run its next action");
      now = wake;
      continue;
    }
    now += step;
    const tolerance = eps * (now > 1.0 ? now : 1.0);
    for (let i = 0; i < moving; i++) {
      const r = advancing[i], heap = finishing[r], at = clock[r] + step * advancingRate[i];
      clock[r] = at;
      while (heap.size && heap.key[0] - at <= tolerance) {
        const q = heap.pop(), a = runN[q];
        running[q] = 0;
        demand[r] -= runShare[q];
        heads[q]++;
        remaining--;
        end[a] = now;
        freeAt[q] = now + gap;
        outAction[count] = a; outStart[count] = runStart[q]; outEnd[count] = now; outCopy[count++] = 0;
        const s = stage[a], k = kind[a];
        for (let j = lanesAt[s]; j < lanesAt[s + 1]; j++) mark(lanes[j]);
        if (k === forward) {
          if (s + 1 < S) for (let j = lanesAt[s + 1]; j < lanesAt[s + 2]; j++) mark(lanes[j]);
        } else if ((k === backward || k === inputGrad) && s > 0) {
          for (let j = lanesAt[s - 1]; j < lanesAt[s]; j++) mark(lanes[j]);
        }
      }
    }
  }
  return { action: outAction, start: outStart, end: outEnd, copy: outCopy, count };
}

// A mesh rank's collectives for the loop's rows (pipexplore/predict/mesh_costs.py's collective_rows,
// in its order: per action as the loop emitted them, then FSDP's placements): a tensor-parallel
// all-reduce closes its action, a context-parallel gather opens it, the experts' exchange follows,
// FSDP's gathers open a forward (and a backward that gathers again), the step-end data-parallel
// collectives open the update. Each row: its action (its lane is the action's stage's), start, end.
function collectiveRows(m, points, loop, placed) {
  const c = m.collectives, S = m.stages, L = m.layers, n = m.actions;
  const sums = {};
  c.names.forEach((name, k) => { sums[name] = stageSums(c.seconds, k * L, points, S, L); });
  const rows = c.rows, names = m.kind_names, stage = m.stage, micro = m.micro, kind = m.kind;
  const begin = new Float64Array(n), finish = new Float64Array(n);
  for (let r = 0; r < loop.count; r++) {
    if (!loop.copy[r]) { begin[loop.action[r]] = loop.start[r]; finish[loop.action[r]] = loop.end[r]; }
  }
  const any = placed && (placed.unshards.length || placed.reduces.length || placed.again.length);
  const stepEnd = any ? sums.step_end.map((v, s) => v - sums.reduce_grad[s]) : sums.step_end;
  const wide = m.micro_batches + 1, again = new Set();  // (stage, micro-batch) of backwards that gather again
  if (placed) for (const a of placed.again) again.add(stage[a] * wide + micro[a]);
  const action = [], start = [], end = [];
  const add = (a, from, to) => { action.push(a); start.push(from); end.push(to); };
  for (let r = 0; r < loop.count; r++) {
    if (loop.copy[r]) continue;
    const a = loop.action[r], s = stage[a], i = micro[a], p = names[kind[a]], t0 = begin[a], t1 = finish[a];
    const forwardLike = p === "forward" || p === "recompute";
    if ((forwardLike || p === "backward" || p === "input_grad") && i >= 0) {
      const size = rows[i % rows.length];
      const tp = (forwardLike ? sums.tp_forward : sums.tp_backward)[s] * size;
      if (tp > 0) add(a, Math.max(t0, t1 - tp), t1);
      if (sums.context[s] > 0) add(a, t0, Math.min(t1, t0 + sums.context[s] * size));
      if (sums.exchange[s] > 0) {
        const from = t0 + sums.context[s] * size;
        add(a, from, Math.min(t1, from + sums.exchange[s] * size));
      }
      const gather = sums.gather[s];
      if (gather > 0 && (p === "forward" || (p === "backward" && again.has(s * wide + i)))) {
        const shown = Math.min(sums[`${p}_gather_exposed`][s], gather);
        if (shown > 0) add(a, t0, Math.min(t1, t0 + shown));
        if (gather > shown) add(a, t0 + shown, Math.min(t1, t0 + gather));
      }
    } else if (p === "optimizer" && stepEnd[s] > 0) {
      add(a, t0, Math.min(t1, t0 + stepEnd[s]));
    }
  }
  for (const [use, seconds, atStart, release, exposed] of placed ? placed.unshards : []) {
    if (!(seconds > 0)) continue;  // a stage without parameters gathers nothing
    if (atStart) {
      add(use, release - seconds, release);
    } else {
      if (seconds > exposed) add(use, begin[use] - (seconds - exposed), begin[use]);
      if (exposed > 0) add(use, begin[use], begin[use] + exposed);
    }
  }
  for (const [after, seconds] of placed ? placed.reduces : []) {
    if (seconds > 0) add(after, finish[after], finish[after] + seconds);
  }
  return { action, start, end, count: action.length };
}

// The bubble of a step: per key (a stage, or a device for interleaved: `keyOf[stage]`), the share
// of the step it computed nothing (overlapping spans counted once), averaged over the keys. `order`
// holds the rows by lane then start, `offsets` each lane's bounds, `laneKey` each lane's key.
function bubbleOf(rows, m, order, offsets, laneKey, total) {
  const keys = new Map();  // key -> its lanes
  laneKey.forEach((key, lane) => { if (!keys.has(key)) keys.set(key, []); keys.get(key).push(lane); });
  if (!(total > 0) || !keys.size) return 0.0;
  let sum = 0.0;
  for (const lanes of keys.values()) {
    let spans = [];
    for (const lane of lanes) spans.push(order.subarray(offsets[lane], offsets[lane + 1]));
    if (spans.length > 1) {  // several lanes (an interleaved device's stages): one list by start
      spans = [Int32Array.from(spans.flatMap((part) => Array.from(part)))
        .sort((a, b) => rows.start[a] - rows.start[b] || a - b)];
    }
    let busy = 0.0, reach = -Infinity;
    for (const r of spans[0]) {
      if (rows.copy[r]) continue;
      const s = rows.start[r], e = rows.end[r];
      busy += Math.max(e - Math.max(s, reach), 0.0);
      if (e > reach) reach = e;
    }
    sum += 1.0 - busy / total;
  }
  return sum / keys.size;
}

// The loop's rows, then a mesh rank's collectives where the panel has their stage's lane
// (`collective_lane`; -1: none): one list of action, start, end and whether a copy.
function withCollectives(m, points, loop, placed, panel) {
  if (!m.collectives) return loop;
  const extra = collectiveRows(m, points, loop, placed), lanes = panel.collective_lane || [];
  const keep = [];
  for (let k = 0; k < extra.count; k++) if ((lanes[m.stage[extra.action[k]]] ?? -1) >= 0) keep.push(k);
  const n = loop.count + keep.length;
  const action = new Int32Array(n), start = new Float64Array(n), end = new Float64Array(n), copy = new Uint8Array(n);
  action.set(loop.action.subarray(0, loop.count));
  start.set(loop.start.subarray(0, loop.count));
  end.set(loop.end.subarray(0, loop.count));
  copy.set(loop.copy.subarray(0, loop.count));
  keep.forEach((k, j) => {
    const r = loop.count + j;
    action[r] = extra.action[k]; start[r] = extra.start[k]; end[r] = extra.end[k];
  });
  return { action, start, end, copy, count: n };
}

// The plan with `splits` re-timed: the predicted panel's blocks (as block_panel lays them out:
// by lane, then start), its step (ms) and bubble. `panel` supplies each stage's lane (`lane_of`),
// its collectives lane (`collective_lane`), the phase code of each kind and of a copy (`codes`:
// F B R I W O, then copy) and of a collective (`collective_code`).
function retime(m, splits, panel) {
  const S = m.stages, L = m.layers;
  if (splits.length !== S - 1) throw new Error(`${S} stages need ${S - 1} splits, got ${splits.length}`);
  const points = [0, ...splits, L];
  for (let s = 0; s < S; s++) {
    if (!(Number.isInteger(points[s + 1]) && points[s + 1] > points[s])) throw new Error(`splits out of order: ${splits}`);
  }
  const costs = actionCosts(m, points);
  const loop = shareLoop(m, costs);
  const rows = withCollectives(m, points, loop, costs.placed, panel);
  const n = rows.count, laneOf = panel.stage_lane, lanes = panel.lanes;
  let origin = Infinity, last = -Infinity;
  for (let r = 0; r < n; r++) { origin = Math.min(origin, rows.start[r]); last = Math.max(last, rows.end[r]); }
  // By lane (counting), then start, then the order the loop emitted them (as the kernel's sorts).
  const lane = new Int32Array(n), offsets = new Array(lanes + 1).fill(0), stageOf = m.stage;
  for (let r = 0; r < n; r++) {
    lane[r] = r < loop.count ? laneOf[stageOf[rows.action[r]]] : panel.collective_lane[stageOf[rows.action[r]]];
    offsets[lane[r] + 1]++;
  }
  for (let q = 0; q < lanes; q++) offsets[q + 1] += offsets[q];
  const order = new Int32Array(n), fill = offsets.slice(0, lanes);
  for (let r = 0; r < n; r++) order[fill[lane[r]]++] = r;
  // Within a lane the loop emits rows nearly by start (a copy comes right after the action before
  // it): an insertion sort, by start then emission.
  const starts = rows.start;
  for (let q = 0; q < lanes; q++) {
    for (let i = offsets[q] + 1; i < offsets[q + 1]; i++) {
      const r = order[i], t = starts[r];
      let j = i;
      for (; j > offsets[q] && (starts[order[j - 1]] > t || (starts[order[j - 1]] === t && order[j - 1] > r)); j--) {
        order[j] = order[j - 1];
      }
      order[j] = r;
    }
  }
  const start = new Float32Array(n), stop = new Float32Array(n), phase = new Uint8Array(n);
  const micro = panel.micro_bytes === 4 ? new Int32Array(n) : new Uint16Array(n);
  const codes = Uint8Array.from(panel.codes), kinds = m.kind, micros = m.micro, action = rows.action;
  const ends = rows.end, copied = rows.copy, copyCode = codes[codes.length - 1];
  for (let i = 0; i < n; i++) {
    const r = order[i], a = action[r];
    start[i] = (starts[r] - origin) * 1e3;
    stop[i] = (ends[r] - origin) * 1e3;
    phase[i] = r >= loop.count ? panel.collective_code : copied[r] ? copyCode : codes[kinds[a]];
    micro[i] = micros[a];
  }
  const keyOf = panel.bubble_key || Array.from({ length: S }, (_, s) => s);
  const laneKey = new Array(lanes);
  for (let s = 0; s < S; s++) laneKey[laneOf[s]] = keyOf[s];
  return {
    start, end: stop, phase, micro, offsets, count: n, step: (last - origin) * 1e3,
    bubble: bubbleOf(rows, m, order, offsets, laneKey, last - origin),
    stage_layers: Array.from({ length: S }, (_, s) => [points[s], points[s + 1] - 1]),
  };
}
