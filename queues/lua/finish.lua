--[[ finish: a request ends (done, failed, or cancelled by its client); its slot is free.
Moves: running -> finished, running -> failed, running -> cancelled
KEYS[1] running zset   KEYS[2] request hash   KEYS[3] output stream   KEYS[4] metrics hash
ARGV[1] id   ARGV[2] worker id   ARGV[3] claim_seq the worker holds
ARGV[4] final status (finished|failed|cancelled)   ARGV[5] now (ms)
ARGV[6] retention (s) of the hash and stream after the end
ARGV[7] completion tokens   ARGV[8] finish reason
ARGV[9] histogram bucket upper bounds in ms, comma-separated, ascending (queues/metrics.py)
ARGV[10..] the last stream event as field, value pairs (a cancel: type error, code cancelled)
Returns 1, or 0 when this worker no longer holds that claim (its lease ran out and the request
was requeued, maybe claimed again): then nothing is written, so a request never ends twice and
is counted once.
Metrics (fields of KEYS[4], by the request's priority p, see queues/metrics.py):
  requests:<p>:<status> +1; for a finished request also prompt_tokens:<p>, completion_tokens:<p>
  and one observation in each histogram (queue_ms, first_token_ms, latency_ms): the bucket
  <name>:<p>:le=<bound> (non-cumulative; le=+Inf above the last bound) and <name>:<p>:sum. ]]
if not owns(KEYS[2], ARGV[2], ARGV[3]) then
  return 0
end
local p = close(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[4], ARGV[5], tonumber(ARGV[6]),
  ARGV[7], ARGV[8], {unpack(ARGV, 10)})

if ARGV[4] == 'finished' then
  local now = tonumber(ARGV[5])
  local t = redis.call('HMGET', KEYS[2], 'enqueued_ms', 'claimed_ms', 'first_token_ms', 'prompt_tokens')
  local enqueued = tonumber(t[1]) or now
  local claimed = tonumber(t[2]) or now
  local first = tonumber(t[3]) or now  -- no token event (an immediate end): the done event is first
  redis.call('HINCRBY', KEYS[4], 'prompt_tokens:' .. p, tonumber(t[4]) or 0)
  redis.call('HINCRBY', KEYS[4], 'completion_tokens:' .. p, tonumber(ARGV[7]) or 0)
  local function observe(name, value)
    if value < 0 then value = 0 end
    local le = '+Inf'
    for bound in string.gmatch(ARGV[9], '[^,]+') do
      if value <= tonumber(bound) then
        le = bound
        break
      end
    end
    redis.call('HINCRBY', KEYS[4], name .. ':' .. p .. ':le=' .. le, 1)
    redis.call('HINCRBY', KEYS[4], name .. ':' .. p .. ':sum', value)
  end
  observe('queue_ms', claimed - enqueued)
  observe('first_token_ms', first - enqueued)
  observe('latency_ms', now - enqueued)
end
return 1
