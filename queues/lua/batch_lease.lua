--[[ batch_lease: take, renew or release the right to run a batch (one RQ job at a time).
KEYS[1] batch lease key
ARGV[1] the job's token   ARGV[2] lease length (ms); 0 releases it
Returns 1 when the token holds the lease now (taken or renewed; or released), 0 when another
job's token holds it. A job that died stops renewing; once its lease has run out a new job may
take the batch over. ]]
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
local ms = tonumber(ARGV[2])
if ms <= 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ms)
end
return 1
