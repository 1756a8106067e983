--[[ report: one worker step, in one round trip, fenced. For each request the worker holds, only
if it still holds that claim (status running, this worker, this claim_seq): append the step's
token events, count the tokens so far, record the slot of a request claimed this step (the
worker chooses it once it has seen the prompt: docs/design.md, "Slots"), note the first
token's time (once: an earlier attempt's stays), note a give-way, renew the lease, and say
whether its client asked to cancel. A claim the worker lost (its lease ran out while it was
frozen; the request went back to the queue and perhaps to another worker, or ended) gets
nothing written.
KEYS: running zset, metrics hash; then per request: its hash and its output stream
ARGV: worker id, now (ms), lease deadline (ms), number of requests n; then per request
  (queues/scripts.py `report`): id, claim_seq, tokens generated so far, slot ('' unless claimed
  this step), first token now (1|0), gave way to (a request id, '' for none), priority, prompt
  tokens found in the worker's KV pool ('' unless claimed this step), number of events m, then m events, each its number of fields k and k name, value pairs: the stream
  entry as it is written (queues/records.py `event_fields`: a token event, or the done event
  of one of a request's n answers that is not its last)
Returns one result (ReportResult) per request, in order: LOST (the worker drops it and writes
nothing more), HELD, CANCEL_ASKED (held, and its client asked to cancel).
Metrics: give_ways:<priority> +1 per give-way (queues/metrics.py). ]]
local running, metrics = KEYS[1], KEYS[2]
local worker, now, lease_deadline, n = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local REQUESTS = 5  -- ARGV from here on: the requests' entries
local LOST, HELD, CANCEL_ASKED = 0, 1, 2

local results = {}
local a = REQUESTS
for i = 1, tonumber(n) do
  local req, out = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  local id, claim_seq, generated, slot, first, gave_way_to, priority, cached, m = unpack(ARGV, a, a + 8)
  m = tonumber(m)
  local held = owns(req, worker, claim_seq)
  local at = a + 9
  for j = 1, m do
    local k = tonumber(ARGV[at])
    if held then
      redis.call('XADD', out, '*', unpack(ARGV, at + 1, at + 2 * k))
    end
    at = at + 1 + 2 * k
  end
  if not held then
    results[i] = LOST
  else
    redis.call('HSET', req, 'completion_tokens', generated)
    if slot ~= '' then
      redis.call('HSET', req, 'slot', slot)
    end
    if cached ~= '' then
      redis.call('HSET', req, 'cached_tokens', cached)
    end
    if first == '1' then
      redis.call('HSETNX', req, 'first_token_ms', now)
    end
    if gave_way_to ~= '' then
      redis.call('HINCRBY', req, 'yields', 1)
      redis.call('HSET', req, 'parked_ms', now, 'gave_way_to', gave_way_to)
      redis.call('HINCRBY', metrics, 'give_ways:' .. priority, 1)
    end
    redis.call('ZADD', running, 'XX', lease_deadline, id)
    if redis.call('HEXISTS', req, 'cancel_requested_ms') == 1 then
      results[i] = CANCEL_ASKED
    else
      results[i] = HELD
    end
  end
  a = at
end
return results
