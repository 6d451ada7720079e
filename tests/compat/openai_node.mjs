// openai-node against a hotloop server: HTTP JSON, SSE streaming and ResponsesWS (WebSocket mode).
// Usage: node openai_node.mjs http://127.0.0.1:PORT/v1   Prints one JSON summary line; exits 1 on failure.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const baseURL = process.argv[2];
const client = new OpenAI({ apiKey: 'sk-test', baseURL, maxRetries: 0 });
const out = {};

const r = await client.responses.create({ model: 'hotloop-sim', input: 'Say hello.' });
out.json = { status: r.status, text: r.output_text, total: r.usage.total_tokens };

const stream = await client.responses.create({ model: 'hotloop-sim', input: 'Stream please.', stream: true });
const types = [];
let deltas = '';
let final;
for await (const ev of stream) {
  types.push(ev.type);
  if (ev.type === 'response.output_text.delta') deltas += ev.delta;
  if (ev.type === 'response.completed') final = ev.response;
}
const finalText = final.output.flatMap((o) => (o.type === 'message' ? o.content : [])).map((c) => c.text).join('');
out.sse = { first: types[0], last: types.at(-1), count: types.length, matches: finalText === deltas && deltas.length > 0 };

const ws = new ResponsesWS(client);
async function turn(params) {
  const done = new Promise((resolve, reject) => {
    const seen = [];
    const onEvent = (ev) => {
      seen.push(ev.type);
      if (ev.type === 'response.completed') { ws.off('event', onEvent); resolve({ seen, response: ev.response }); }
      if (ev.type === 'error' || ev.type === 'response.failed') { ws.off('event', onEvent); reject(new Error(JSON.stringify(ev))); }
    };
    ws.on('event', onEvent);
  });
  ws.send({ type: 'response.create', model: 'hotloop-sim', store: false, ...params });
  return done;
}
const t1 = await turn({ input: 'hello over websocket' });
const t2 = await turn({ input: 'again', previous_response_id: t1.response.id });
out.ws = {
  first: t1.seen[0],
  last: t2.seen.at(-1),
  chained: t2.response.previous_response_id === t1.response.id,
  cached: t2.response.usage.input_tokens_details.cached_tokens,
  firstTotal: t1.response.usage.total_tokens,
};
ws.close({ code: 1000, reason: 'done' });
console.log(JSON.stringify(out));
