// The Vercel AI SDK (@ai-sdk/openai, Responses API) against a hotloop server:
// streamText, a generateText tool loop (call -> execute -> answer), a multi-turn chat, and
// reasoning shown through summaries (reasoningSummary) and referred to in the next turn.
// Usage: node ai_sdk.mjs http://127.0.0.1:PORT/v1   Prints one JSON summary line; exits 1 on failure.
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText, tool, jsonSchema, stepCountIs } from 'ai';

const openai = createOpenAI({ apiKey: 'sk-test', baseURL: process.argv[2] });
const model = openai.responses('hotloop-sim');
const out = {};

const s = streamText({ model, prompt: 'Say hello.' });
let text = '';
for await (const part of s.textStream) text += part;
const usage = await s.usage;
out.stream = { text, inputTokens: usage.inputTokens, outputTokens: usage.outputTokens, finish: await s.finishReason };

let executed = null;
const g = await generateText({
  model,
  prompt: 'What is the weather in Paris?',
  tools: {
    get_weather: tool({
      description: 'Get the weather for a city',
      inputSchema: jsonSchema({
        type: 'object',
        properties: { city: { type: 'string' } },
        required: ['city'],
        additionalProperties: false,
      }),
      execute: async ({ city }) => { executed = city; return { city, forecast: 'sunny' }; },
    }),
  },
  stopWhen: stepCountIs(3),
});
out.tools = { executed, steps: g.steps.length, finalText: g.text.length > 0, finish: g.finishReason };

// A multi-turn chat: from the second turn on the SDK sends earlier assistant output as
// item_reference items (store defaults to true) without previous_response_id.
const history = [{ role: 'user', content: 'Hello there.' }];
const t1 = await generateText({ model, messages: history });
const t2 = await generateText({ model, messages: [...history, ...t1.response.messages, { role: 'user', content: 'And again?' }] });
out.chat = { first: t1.text.length > 0, second: t2.text.length > 0, grew: t2.usage.inputTokens > t1.usage.inputTokens };

// Reasoning: the SDK reads only reasoning summaries (it has no handler for reasoning_text). With
// reasoningSummary set, hotloop streams the model's reasoning verbatim as the summary. The next
// turn (store: true, the default) refers to the reasoning item by id (item_reference), which
// hotloop resolves to the stored item: its summary is the history the backend gets. (With
// store: false this SDK drops reasoning items without encrypted_content from the next input.)
// A fetch wrapper records the request bodies.
const sent = [];
const recording = createOpenAI({
  apiKey: 'sk-test',
  baseURL: process.argv[2],
  fetch: async (url, init) => {
    if (init?.body) sent.push(JSON.parse(init.body));
    return fetch(url, init);
  },
});
const rmodel = recording.responses('hotloop-sim');
const providerOptions = {
  openai: { forceReasoning: true, reasoningSummary: 'auto', metadata: { sim: 'reasoning,tokens:8' } },
};
const prompt = 'Think first, then say hello.';
const r = streamText({ model: rmodel, prompt, providerOptions });
let streamed = '';
let answer = '';
for await (const part of r.fullStream) {
  if (part.type === 'reasoning-delta') streamed += part.text ?? part.delta ?? '';
  if (part.type === 'text-delta') answer += part.text ?? part.delta ?? '';
}
const reasoningText = await r.reasoningText;
const { messages } = await r.response;
const itemId = messages[0].content.find((p) => p.type === 'reasoning')?.providerOptions?.openai?.itemId ?? null;
const r2 = await generateText({
  model: rmodel,
  messages: [{ role: 'user', content: prompt }, ...messages, { role: 'user', content: 'Again.' }],
  providerOptions,
});
const followUp = sent[sent.length - 1];
out.reasoning = {
  streamed,
  text: reasoningText ?? null,
  answer: answer.length > 0,
  requested: sent[0].reasoning ?? null,
  itemId,
  referenced: followUp.input.filter((i) => i.type === 'item_reference').map((i) => i.id),
  generated: r2.reasoningText ?? '',
  finish: r2.finishReason,
};
console.log(JSON.stringify(out));
