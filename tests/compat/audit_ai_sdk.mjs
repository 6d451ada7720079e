// The Vercel AI SDK (@ai-sdk/openai Responses provider) against a hotloop server, beyond
// ai_sdk.mjs: multi-step tool loops with parallel calls and reasoning (stopWhen), store:false,
// providerOptions.openai.previousResponseId, abort, length finish, errors, structured output.
// Usage: node audit_ai_sdk.mjs http://127.0.0.1:PORT/v1 CASE   Prints one JSON line.
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText, tool, jsonSchema, stepCountIs, Output } from 'ai';

globalThis.AI_SDK_LOG_WARNINGS = false;
const [baseURL, which] = process.argv.slice(2);
const openai = createOpenAI({ apiKey: 'sk-test', baseURL });
const model = openai.responses('hotloop-sim');
const active = async () => (await (await fetch(baseURL.replace(/\/v1$/, '/healthz'))).json()).active_responses;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const settle = async () => { for (let i = 0; i < 40 && (await active()) !== 0; i++) await sleep(25); return active(); };
const calls = [];
const tools = {
  get_weather: tool({
    description: 'Get the weather for a city',
    inputSchema: jsonSchema({ type: 'object', properties: { city: { type: 'string' } }, required: ['city'], additionalProperties: false }),
    execute: async ({ city }) => { calls.push(city); return { city, forecast: 'sunny' }; },
  }),
};
const errInfo = (e) => ({ name: e.name, status: e.statusCode ?? null, retryable: e.isRetryable ?? null, message: String(e.message).slice(0, 200) });

async function loop(opts) {
  calls.length = 0;
  const s = streamText({ model, prompt: 'weather?', tools, stopWhen: stepCountIs(5), maxRetries: 0, providerOptions: { openai: opts } });
  const errors = [];
  for await (const p of s.fullStream) if (p.type === 'error' || p.type === 'tool-error') errors.push(String(p.error?.message ?? p.error).slice(0, 200));
  const steps = await s.steps;
  return {
    calls: calls.length, steps: steps.length, finish: await s.finishReason, text: (await s.text).length > 0, errors,
    perStep: steps.map((st) => st.content.map((c) => c.type).filter((t, i, a) => a.indexOf(t) === i).join(',')),
    responseId: (await s.providerMetadata)?.openai?.responseId ?? null,
  };
}

const cases = {
  // run against a server scripted ["reasoning,tools:3", "reasoning,text"]: parallel calls and
  // reasoning over two steps, store true (item_reference for the reasoning item) and false
  async steps() {
    const stored = await loop({});
    const forced = await loop({ forceReasoning: true });
    const unstored = await loop({ forceReasoning: true, store: false });
    // the next user turn continues the loop's last response with previousResponseId
    const next = streamText({ model, messages: [{ role: 'user', content: 'and tomorrow?' }], tools, stopWhen: stepCountIs(5), maxRetries: 0,
      providerOptions: { openai: { previousResponseId: stored.responseId } } });
    const errs = []; for await (const p of next.fullStream) if (p.type === 'error') errs.push(String(p.error?.message ?? p.error).slice(0, 200));
    const u = await next.usage;
    return { stored, forced, unstored, next: { finish: await next.finishReason, errs, inputTokens: u.inputTokens, text: (await next.text).length > 0 } };
  },
  // store:false over two steps (a server scripted as for steps): what the SDK sends, captured by
  // its fetch. It keeps a reasoning item for the next request only with its encrypted_content,
  // read from output_item.done (without one it drops the item: "Reasoning parts without encrypted
  // content are not supported when store is false"). It asks for it (include) only for a model it
  // knows as a reasoning one (forceReasoning here); hotloop returns it whenever store is false.
  async unstored_reasoning() {
    const run = async (opts) => {
      const sent = [];
      const capturing = createOpenAI({ apiKey: 'sk-test', baseURL, fetch: async (url, init) => {
        if (String(url).endsWith('/responses')) sent.push(JSON.parse(init.body));
        return fetch(url, init);
      } });
      const warnings = [];
      const s = streamText({ model: capturing.responses('hotloop-sim'), prompt: 'weather?', tools, stopWhen: stepCountIs(5), maxRetries: 0,
        providerOptions: { openai: { store: false, ...opts } } });
      for await (const p of s.fullStream) if (p.type === 'start-step') warnings.push(...(p.warnings ?? []).map((w) => w.message ?? String(w)));
      const steps = await s.steps;
      const reasoningOf = (body) => body.input.filter((i) => i.type === 'reasoning')
        .map((i) => ({ id: i.id ?? null, summary: i.summary.length, sealed: typeof i.encrypted_content === 'string' ? i.encrypted_content.slice(0, 4) : null }));
      const streamed = steps[0].content.filter((c) => c.type === 'reasoning');
      return {
        requests: sent.length, include: sent.map((b) => b.include ?? null), store: sent.map((b) => b.store),
        second: sent.length > 1 ? reasoningOf(sent[1]) : null,
        // the item the SDK kept from step 1 (its providerMetadata), as step 2 sent it back
        kept: streamed.map((c) => (c.providerMetadata?.openai?.reasoningEncryptedContent ?? '').slice(0, 4)),
        sameToken: sent.length > 1 && streamed.length > 0
          && sent[1].input.some((i) => i.type === 'reasoning' && i.encrypted_content === streamed[0].providerMetadata?.openai?.reasoningEncryptedContent),
        warnings: warnings.filter((w) => /reasoning/i.test(w)), finish: await s.finishReason, steps: steps.length,
      };
    };
    return { plain: await run({}), forced: await run({ forceReasoning: true }) };
  },
  // previousResponseId: context carried (input tokens grow); an unknown id is a typed 400
  async previous() {
    const t1 = await generateText({ model, prompt: 'hello there', maxRetries: 0 });
    const id = t1.providerMetadata?.openai?.responseId;
    const t2 = await generateText({ model, prompt: 'again', maxRetries: 0, providerOptions: { openai: { previousResponseId: id } } });
    const lone = await generateText({ model, prompt: 'again', maxRetries: 0 });
    let bad = null;
    try { await generateText({ model, prompt: 'again', maxRetries: 0, providerOptions: { openai: { previousResponseId: 'resp_nope' } } }); } catch (e) { bad = { ...errInfo(e), body: JSON.parse(e.responseBody).error }; }
    return { id: typeof id === 'string' && id.startsWith('resp_'), t1: t1.usage.inputTokens, t2: t2.usage.inputTokens, lone: lone.usage.inputTokens,
      t1out: t1.usage.outputTokens, bad };
  },
  // an AbortSignal mid-stream: the stream ends, the server's response ends, the next call works
  async abort() {
    const ac = new AbortController();
    const s = streamText({ model, prompt: 'long', abortSignal: ac.signal, maxRetries: 0, onError: () => {}, providerOptions: { openai: { metadata: { sim: 'text,rate:50,tokens:500' } } } });
    let n = 0; let during = null;
    try { for await (const _ of s.textStream) if (++n === 3) { during = await active(); ac.abort(); } } catch (e) { /* aborted */ }
    const after = await settle();
    const g = await generateText({ model, prompt: 'again', maxRetries: 0, providerOptions: { openai: { metadata: { sim: 'text,tokens:5' } } } });
    return { n, during, after, next: g.finishReason };
  },
  // finish reasons and errors as the SDK reports them
  async finish() {
    const length = await generateText({ model, prompt: 'long', maxOutputTokens: 16, maxRetries: 0, providerOptions: { openai: { metadata: { sim: 'tokens:100' } } } });
    const s = streamText({ model, prompt: 'x', maxRetries: 0, onError: () => {}, providerOptions: { openai: { metadata: { sim: 'text,tokens:10,fail:server_error' } } } });
    const parts = []; for await (const p of s.fullStream) parts.push(p.type);
    let badParam = null; try { await generateText({ model, prompt: 'x', temperature: 9, maxRetries: 0 }); } catch (e) { badParam = { ...errInfo(e), param: JSON.parse(e.responseBody).error.param }; }
    let limited = null; try { await generateText({ model, prompt: 'x', maxRetries: 0, providerOptions: { openai: { metadata: { sim: 'rate_limit' } } } }); } catch (e) { limited = errInfo(e); }
    return { length: { finish: length.finishReason, raw: length.rawFinishReason, out: length.usage.outputTokens },
      failed: { finish: await s.finishReason, error: parts.includes('error') }, badParam, limited };
  },
  // structured output: Output.object (text.format json_schema)
  async structured() {
    const schema = jsonSchema({ type: 'object', properties: { city: { type: 'string' }, temp: { type: 'integer' } }, required: ['city', 'temp'], additionalProperties: false });
    const out = {};
    try { const g = await generateText({ model, prompt: 'weather as json', maxRetries: 0, output: Output.object({ schema }) }); out.generate = g.output; } catch (e) { out.generate = { threw: e.name }; }
    try {
      const s = streamText({ model, prompt: 'weather as json', maxRetries: 0, onError: () => {}, output: Output.object({ schema }) });
      await s.consumeStream(); out.stream = await s.output;
    } catch (e) { out.stream = { threw: e.name }; }
    return out;
  },
};

const result = await cases[which]();
console.log(JSON.stringify(result));
