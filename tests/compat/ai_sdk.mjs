// The Vercel AI SDK (@ai-sdk/openai, Responses API) against a hotloop server:
// streamText, a generateText tool loop (call -> execute -> answer) and a multi-turn chat.
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
console.log(JSON.stringify(out));
