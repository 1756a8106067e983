--[[ finish: a request ends (done, failed, or cancelled by its client); its slot is free.
Moves: running -> finished, running -> failed, running -> cancelled
KEYS: running zset, request hash, output stream, metrics hash
ARGV: request id, worker id, claim_seq the worker holds, final status
  (finished|failed|cancelled), now (ms), retention (s) of the hash and stream after the end,
  completion tokens, finish reason, histogram bucket upper bounds in ms, comma-separated,
  ascending (queues/metrics.py); then the last stream event as field, value pairs (none for a
  cancel: _lib.lua's cancelled_event)
Returns (FinishResult) ENDED, or LOST when this worker no longer holds that claim (its lease ran
out and the request was requeued, maybe claimed again): then nothing is written, so a request
never ends twice and is counted once.
Metrics (fields of the metrics hash, by the request's priority p, see queues/metrics.py):
  requests:<p>:<status> +1; for a finished request also prompt_tokens:<p>, completion_tokens:<p>
  and one observation in each histogram (queue_ms, first_token_ms, latency_ms): the bucket
  <name>:<p>:le=<bound> (non-cumulative; le=+Inf above the last bound) and <name>:<p>:sum. ]]
local running, req, out, metrics = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, worker, claim_seq, status, now, ttl, completion_tokens, reason, bounds = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local EVENT = 10  -- ARGV from here on: the last event's field, value pairs
local LOST, ENDED = 0, 1

if not owns(req, worker, claim_seq) then
  return LOST
end
local event = {unpack(ARGV, EVENT)}
if #event == 0 and status == 'cancelled' then
  event = cancelled_event()
end
local p = close(running, req, out, metrics, id, status, now, tonumber(ttl), completion_tokens, reason, event)

if status == 'finished' then
  local at = tonumber(now)
  local t = redis.call('HMGET', req, 'enqueued_ms', 'claimed_ms', 'first_token_ms', 'prompt_tokens')
  local enqueued = tonumber(t[1]) or at
  local claimed = tonumber(t[2]) or at
  local first = tonumber(t[3]) or at  -- no token event (an immediate end): the done event is first
  redis.call('HINCRBY', metrics, 'prompt_tokens:' .. p, tonumber(t[4]) or 0)
  redis.call('HINCRBY', metrics, 'completion_tokens:' .. p, tonumber(completion_tokens) or 0)
  local function observe(name, value)
    if value < 0 then value = 0 end
    local le = '+Inf'
    for bound in string.gmatch(bounds, '[^,]+') do
      if value <= tonumber(bound) then
        le = bound
        break
      end
    end
    redis.call('HINCRBY', metrics, name .. ':' .. p .. ':le=' .. le, 1)
    redis.call('HINCRBY', metrics, name .. ':' .. p .. ':sum', value)
  end
  observe('queue_ms', claimed - enqueued)
  observe('first_token_ms', first - enqueued)
  observe('latency_ms', at - enqueued)
end
return ENDED
