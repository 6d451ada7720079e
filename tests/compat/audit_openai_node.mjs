// openai-node against a hotloop server, beyond openai_node.mjs: the responses.stream() helper
// (parallel calls, reasoning, accumulated snapshots), max_output_tokens -> incomplete, typed
// errors, retrieve/delete/inputItems pagination, AbortController mid-stream, ResponsesWS close.
// Usage: node audit_openai_node.mjs http://127.0.0.1:PORT/v1 CASE   Prints one JSON line.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const [baseURL, which, apiKey = 'sk-test'] = process.argv.slice(2);
const client = new OpenAI({ apiKey, baseURL, maxRetries: 0, timeout: 8000 });
const active = async () => (await (await fetch(baseURL.replace(/\/v1$/, '/healthz'))).json()).active_responses;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const settle = async () => { for (let i = 0; i < 40 && (await active()) !== 0; i++) await sleep(25); return active(); };
const tools = [{
  type: 'function', name: 'get_weather', strict: true,
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'], additionalProperties: false },
}];
const errInfo = (e) => ({ cls: e.constructor.name, status: e.status ?? null, code: e.code ?? null, param: e.param ?? null, type: e.type ?? null,
  retryAfter: e.headers?.get?.('retry-after') ?? null, requestID: e.requestID ?? null });
async function expectError(fn) { try { await fn(); return { cls: 'none' }; } catch (e) { return errInfo(e); } }

const cases = {
  // responses.stream(): reasoning + three parallel calls, the accumulated final response
  async stream_parallel() {
    const s = client.responses.stream({ model: 'hotloop-sim', input: 'weather?', tools, metadata: { sim: 'reasoning,tools:3,tokens:6' } });
    const types = []; const seqs = []; let completed; const snaps = {};
    s.on('event', (e) => { types.push(e.type); seqs.push(e.sequence_number); });
    s.on('response.completed', (e) => { completed = e.response; });
    s.on('response.function_call_arguments.delta', (e) => { snaps[e.output_index] = e.snapshot; });
    const f = await s.finalResponse();
    const calls = f.output.filter((o) => o.type === 'function_call');
    const stored = await client.responses.retrieve(f.id);
    return {
      status: f.status, types: f.output.map((o) => o.type), first: types[0], last: types.at(-1),
      seqOk: seqs.every((n, i) => n === i),
      callIds: new Set(calls.map((c) => c.call_id)).size, outputIdx: Object.keys(snaps).map(Number),
      snapsMatch: calls.every((c, i) => snaps[i + 1] === c.arguments),
      parsed: calls.map((c) => c.parsed_arguments), statuses: calls.map((c) => c.status),
      reasoningText: f.output[0].content?.map((c) => c.text).join('') ?? '',
      sameAsCompleted: JSON.stringify(completed.output) === JSON.stringify(stored.output),
      finalMatchesStored: JSON.stringify(f.output.map((o) => ({ ...o, parsed_arguments: undefined }))) === JSON.stringify(stored.output),
    };
  },
  // a tool loop over previous_response_id with the stream helper: outputs for every parallel call
  async stream_loop() {
    const r1 = await client.responses.stream({ model: 'hotloop-sim', input: 'weather?', tools, metadata: { sim: 'tools:2' } }).finalResponse();
    const outs = r1.output.filter((o) => o.type === 'function_call').map((o) => ({ type: 'function_call_output', call_id: o.call_id, output: 'sunny' }));
    const r2 = await client.responses.stream({ model: 'hotloop-sim', previous_response_id: r1.id, input: outs, tools }).finalResponse();
    const items = await client.responses.inputItems.list(r2.id, { order: 'asc', limit: 100 });
    return { r1: r1.output.map((o) => o.type), r2: r2.output.map((o) => o.type), text: r2.output_text.length > 0,
      prev: r2.previous_response_id === r1.id, items: items.data.map((i) => i.type) };
  },
  // max_output_tokens: JSON and the stream helper see status incomplete with the reason
  async incomplete() {
    const j = await client.responses.create({ model: 'hotloop-sim', input: 'long', max_output_tokens: 16, metadata: { sim: 'tokens:100' } });
    const s = client.responses.stream({ model: 'hotloop-sim', input: 'long', max_output_tokens: 16, metadata: { sim: 'tokens:100' } });
    const types = []; s.on('event', (e) => types.push(e.type));
    const f = await s.finalResponse();
    const t = await client.responses.stream({ model: 'hotloop-sim', input: 'x', tools, max_output_tokens: 8, metadata: { sim: 'tools:2' } }).finalResponse();
    return {
      json: { status: j.status, reason: j.incomplete_details?.reason, out: j.usage.output_tokens, items: j.output.map((o) => o.status) },
      stream: { status: f.status, reason: f.incomplete_details?.reason, last: types.at(-1), items: f.output.map((o) => o.status), text: f.output_text.length > 0 },
      tools: { status: t.status, items: t.output.map((o) => o.status), parsed: t.output.map((o) => o.parsed_arguments ?? null) },
    };
  },
  // errors surface as the SDK's typed classes, with the OpenAI fields
  async errors() {
    return {
      badParam: await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'x', temperature: 7 })),
      badParamStream: await expectError(() => client.responses.stream({ model: 'hotloop-sim', input: 'x', temperature: 7 }).finalResponse()),
      prevMissing: await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'x', previous_response_id: 'resp_nope' })),
      prevMissingStream: await expectError(() => client.responses.stream({ model: 'hotloop-sim', input: 'x', previous_response_id: 'resp_nope' }).finalResponse()),
      getMissing: await expectError(() => client.responses.retrieve('resp_nope')),
      deleteMissing: await expectError(() => client.responses.delete('resp_nope')),
      itemsMissing: await expectError(() => client.responses.inputItems.list('resp_nope')),
      backend429: await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'x', metadata: { sim: 'rate_limit' } })),
      midStream: await expectError(() => client.responses.stream({ model: 'hotloop-sim', input: 'x', metadata: { sim: 'text,error' } }).finalResponse()),
      failed: await (async () => { const f = await client.responses.stream({ model: 'hotloop-sim', input: 'x', metadata: { sim: 'text,fail:server_error' } }).finalResponse(); return { status: f.status, code: f.error?.code }; })(),
    };
  },
  // retrieve, delete, inputItems auto-pagination both ways
  async crud() {
    const texts = ['a', 'b', 'c', 'd', 'e'];
    const r = await client.responses.create({ model: 'hotloop-sim', input: texts.map((t) => ({ role: 'user', content: t })), metadata: { sim: 'text,tokens:3' } });
    const g = await client.responses.retrieve(r.id);
    const asc = []; for await (const it of client.responses.inputItems.list(r.id, { limit: 2, order: 'asc' })) asc.push(it.content[0].text);
    const desc = []; for await (const it of client.responses.inputItems.list(r.id, { limit: 2 })) desc.push(it.content[0].text);
    const p1 = await client.responses.inputItems.list(r.id, { limit: 2, order: 'asc' });
    const p2 = await p1.getNextPage(); const p3 = await p2.getNextPage();
    const del = await client.responses.delete(r.id);
    return {
      same: g.id === r.id && g.output_text === r.output_text && g.status === 'completed', asc, desc,
      pages: [p1, p2, p3].map((p) => p.data.length), more: [p1.has_more, p2.has_more, p3.has_more, p3.hasNextPage()],
      ids: p1.data.every((i) => typeof i.id === 'string' && i.id.length > 0),
      del, afterGet: await expectError(() => client.responses.retrieve(r.id)),
      afterPrev: await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'y', previous_response_id: r.id })),
      noStore: await expectError(async () => { const n = await client.responses.create({ model: 'hotloop-sim', input: 'x', store: false }); await client.responses.retrieve(n.id); }),
    };
  },
  // AbortController / stream.abort() mid-stream: the server ends the response, the client goes on
  async abort() {
    const out = {};
    const ac = new AbortController();
    const raw = await client.responses.create({ model: 'hotloop-sim', input: 'x', stream: true, metadata: { sim: 'text,rate:50,tokens:500' } }, { signal: ac.signal });
    let n = 0; let during = null;
    try { for await (const ev of raw) { if (ev.type === 'response.output_text.delta' && ++n === 3) { during = await active(); ac.abort(); } } } catch (e) { out.rawErr = e.constructor.name; }
    out.raw = { n, during, after: await settle() };
    const s = client.responses.stream({ model: 'hotloop-sim', input: 'x', metadata: { sim: 'text,rate:50,tokens:500' } });
    let m = 0; s.on('response.output_text.delta', () => { if (++m === 3) s.abort(); });
    out.helper = { err: (await expectError(() => s.finalResponse())).cls, after: await settle() };
    const ac2 = new AbortController(); setTimeout(() => ac2.abort(), 200);
    out.json = { err: (await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'x', metadata: { sim: 'text,rate:50,tokens:500' } }, { signal: ac2.signal }))).cls, after: await settle() };
    const next = await client.responses.stream({ model: 'hotloop-sim', input: 'again', metadata: { sim: 'text,tokens:5' } }).finalResponse();
    out.next = { status: next.status, text: next.output_text.length > 0 };
    return out;
  },
  // ResponsesWS: a parallel-call round trip, then closing the socket mid-response
  async ws() {
    const ws = new ResponsesWS(client);
    const turn = (params) => new Promise((resolve) => {
      const onEvent = (ev) => { if (['response.completed', 'response.failed', 'response.incomplete'].includes(ev.type)) { off(); resolve({ response: ev.response }); } };
      const onErr = (err) => { off(); resolve({ error: err.error }); };
      const off = () => { ws.off('event', onEvent); ws.off('error', onErr); };
      ws.on('event', onEvent); ws.on('error', onErr);
      ws.send({ type: 'response.create', model: 'hotloop-sim', store: false, ...params });
    });
    const bad = await turn({ input: 'x', previous_response_id: 'resp_nope' });
    const t1 = await turn({ input: 'x', tools, metadata: { sim: 'reasoning,tools:3,tokens:4' } });
    const outs = t1.response.output.filter((o) => o.type === 'function_call').map((o) => ({ type: 'function_call_output', call_id: o.call_id, output: 'sunny' }));
    const t2 = await turn({ input: outs, tools, previous_response_id: t1.response.id });
    let n = 0;
    const mid = new Promise((resolve) => ws.on('event', async (ev) => { if (ev.type === 'response.output_text.delta' && ++n === 3) { ws.close({ code: 1000, reason: 'bye' }); resolve(); } }));
    ws.send({ type: 'response.create', model: 'hotloop-sim', input: 'long', store: false, metadata: { sim: 'text,rate:50,tokens:500' } });
    await mid;
    const after = await settle();
    const ws2 = new ResponsesWS(client); ws2.on('error', () => {});
    const again = await new Promise((resolve) => { ws2.on('event', (ev) => { if (ev.type === 'response.completed') resolve(ev.response.status); }); ws2.send({ type: 'response.create', model: 'hotloop-sim', input: 'again', store: false }); });
    ws2.close();
    return { bad: bad.error, t1: t1.response.output.map((o) => o.type), t2: t2.response?.output.map((o) => o.type), t2status: t2.response?.status, closedAt: n, after, again };
  },
  // structured output: responses.parse / output_parsed with a json_schema text format
  async parse() {
    const schema = { type: 'object', properties: { city: { type: 'string' }, temp: { type: 'integer' }, tags: { type: 'array', items: { type: 'string' } } }, required: ['city', 'temp', 'tags'], additionalProperties: false };
    const text = { format: { type: 'json_schema', name: 'weather', strict: true, schema } };
    const out = {};
    try { const r = await client.responses.parse({ model: 'hotloop-sim', input: 'weather as json', text }); out.parse = { parsed: r.output_parsed, status: r.status }; } catch (e) { out.parse = { threw: e.constructor.name, msg: String(e.message).slice(0, 200) }; }
    try { const f = await client.responses.stream({ model: 'hotloop-sim', input: 'weather as json', text }).finalResponse(); out.stream = { parsed: JSON.parse(f.output_text), echoed: f.text?.format?.type }; } catch (e) { out.stream = { threw: e.constructor.name, msg: String(e.message).slice(0, 200) }; }
    try { const r = await client.responses.create({ model: 'hotloop-sim', input: 'json please', text: { format: { type: 'json_object' } } }); out.jsonObject = { obj: JSON.parse(r.output_text) }; } catch (e) { out.jsonObject = { threw: e.constructor.name, msg: String(e.message).slice(0, 200) }; }
    return out;
  },
  // per-key limits: 429 RateLimitError with the OpenAI fields and retry-after (key from argv)
  async limits() {
    const s1 = await client.responses.create({ model: 'hotloop-sim', input: 'x', stream: true, metadata: { sim: 'text,rate:50,tokens:60' } });
    const concurrent = await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'y', stream: true }));
    let n = 0; for await (const ev of s1) n++;
    let rpm = { cls: 'none' };  // the bucket (RPM 2) runs dry within three more requests
    for (let i = 0; i < 3 && rpm.cls === 'none'; i++) rpm = await expectError(() => client.responses.create({ model: 'hotloop-sim', input: 'y', metadata: { sim: 'text,tokens:2' } }));
    const rpmStream = await expectError(() => client.responses.stream({ model: 'hotloop-sim', input: 'y' }).finalResponse());
    return { first: n > 0, concurrent, rpm, rpmStream };
  },
};

const result = await cases[which]();
console.log(JSON.stringify(result));
