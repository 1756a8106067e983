--[[ report: one worker step, in one round trip, fenced. For each request the worker holds, only
if it still holds that claim (status running, this worker, this claim_seq): append the step's
token events, count the tokens so far, record the slot of a request claimed this step (the
worker chooses it once it has seen the prompt: rule 9), note the first token's time (once: an earlier attempt's
stays), note a give-way, renew the lease, and say whether its client asked to cancel. A claim
the worker lost (its lease ran out while it was frozen; the request went back to the queue and
perhaps to another worker, or ended) gets nothing written.
KEYS[1] running zset   KEYS[2] metrics hash
KEYS[1+2i], KEYS[2+2i] request hash and output stream of the i-th request (i = 1..n)
ARGV[1] worker id   ARGV[2] now (ms)   ARGV[3] lease deadline (ms)   ARGV[4] n
then per request: id, claim_seq, tokens generated so far, slot ('' unless claimed this step),
first token now (1|0), gave way to
(a request id, '' for none), priority, number of token events m, then m pairs text, ids
Returns one code per request, in order: 0 lost (the worker drops it and writes nothing more),
1 held, 2 held and its client asked to cancel.
Metrics: give_ways:<priority> +1 per give-way (queues/metrics.py). ]]
local codes = {}
local a = 5
for i = 1, tonumber(ARGV[4]) do
  local req, out = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  local id, generated, slot = ARGV[a], ARGV[a + 2], ARGV[a + 3]
  local first, gave_way_to, priority = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local m = tonumber(ARGV[a + 7])
  if owns(req, ARGV[1], ARGV[a + 1]) then
    for j = 0, m - 1 do
      redis.call('XADD', out, '*', 'type', 'token', 'text', ARGV[a + 8 + 2 * j], 'ids', ARGV[a + 9 + 2 * j])
    end
    redis.call('HSET', req, 'completion_tokens', generated)
    if slot ~= '' then
      redis.call('HSET', req, 'slot', slot)
    end
    if first == '1' then
      redis.call('HSETNX', req, 'first_token_ms', ARGV[2])
    end
    if gave_way_to ~= '' then
      redis.call('HINCRBY', req, 'yields', 1)
      redis.call('HSET', req, 'parked_ms', ARGV[2], 'gave_way_to', gave_way_to)
      redis.call('HINCRBY', KEYS[2], 'give_ways:' .. priority, 1)
    end
    redis.call('ZADD', KEYS[1], 'XX', ARGV[3], id)
    if redis.call('HEXISTS', req, 'cancel_requested_ms') == 1 then
      codes[i] = 2
    else
      codes[i] = 1
    end
  else
    codes[i] = 0
  end
  a = a + 8 + 2 * m
end
return codes
